"""Activation-aware int4: second moments, the scale and grid searches, and the layer-by-layer pass
that folds scales without changing the float model."""

from __future__ import annotations

import pytest
import torch
from tiny_quant import IDS, tiny_gguf
from torch import nn

from rebar.model.build import build_model
from rebar.model.loader import open_checkpoint
from rebar.quant.awq import (
    ActivationRecorder,
    Grid,
    _expand_kv,
    _quantized,
    _reduce_kv,
    apply_awq,
    group_errors,
    output_error,
    round_fed_back,
    run_sequence,
    scale_groups,
    search_grid,
    search_scales,
)
from rebar.weights.int_formats import SCALE_DTYPE, fake_quantize_int4, quantize_int4_on_grid

GENERATOR = torch.Generator().manual_seed(0)


def outlier_inputs(rows: int = 256, channels: int = 128) -> torch.Tensor:
    """Activations whose few large channels dominate and share a common offset, as in real LLMs."""
    x = torch.randn(rows, channels, generator=GENERATOR) + torch.randn(
        1, channels, generator=GENERATOR
    )
    x[:, :4] *= 30
    return x.double()


def moments_of(x: torch.Tensor) -> torch.Tensor:
    return x.T @ x / x.shape[0]


def direct_error(x: torch.Tensor, weight: torch.Tensor, quantized: torch.Tensor) -> float:
    """Mean over rows and outputs of the squared output error, computed on the rows themselves."""
    return ((x @ quantized.T - x @ weight.T) ** 2).mean().item()


def test_recorder_sums_mean_abs_and_second_moments_over_every_row() -> None:
    layer = nn.Linear(8, 3)
    calls = [torch.randn(5, 8, generator=GENERATOR) for _ in range(3)]
    recorder = ActivationRecorder({"layer": layer})
    with recorder, torch.no_grad():
        for x in calls:
            layer(x)
    everything = torch.cat(calls)
    torch.testing.assert_close(recorder.mean_abs("layer"), everything.abs().mean(0))
    torch.testing.assert_close(recorder.second_moments("layer"), everything.T @ everything / 15)
    assert not layer._forward_pre_hooks  # hooks are removed on exit


def test_second_moment_error_equals_the_error_on_the_rows() -> None:
    x = outlier_inputs()
    weight = torch.randn(16, 128, generator=GENERATOR, dtype=torch.float64) * 0.05
    quantized = fake_quantize_int4(weight, 32).double()
    assert output_error(quantized - weight, moments_of(x)) == pytest.approx(
        direct_error(x, weight, quantized), rel=1e-9
    )


def test_group_errors_equal_each_groups_partial_product_error_on_the_rows() -> None:
    x = outlier_inputs()
    weight = torch.randn(16, 128, generator=GENERATOR, dtype=torch.float64) * 0.05
    delta = fake_quantize_int4(weight, 32).double() - weight
    blocks = torch.stack([moments_of(x)[i : i + 32, i : i + 32] for i in range(0, 128, 32)])
    errors = group_errors(delta.reshape(16, 4, 32), blocks)
    for g in range(4):
        part = x[:, 32 * g : 32 * (g + 1)] @ delta[:, 32 * g : 32 * (g + 1)].T  # [rows, out]
        torch.testing.assert_close(errors[:, g], (part**2).mean(0), rtol=1e-9, atol=0)


def test_scale_search_beats_round_to_nearest_on_outlier_channels() -> None:
    x = outlier_inputs().float()
    weight = torch.randn(64, 128, generator=GENERATOR) * 0.05
    search = search_scales(weight, moments_of(x), x.abs().mean(0), group_size=32)
    plain = direct_error(x, weight, fake_quantize_int4(weight, 32))
    assert search.unscaled_error == pytest.approx(
        plain, rel=1e-4
    )  # alpha = 0 is plain round-to-nearest
    assert search.alpha > 0 and search.error < 0.7 * search.unscaled_error
    assert search.scales.shape == (128,)


def test_scale_search_never_does_worse_than_round_to_nearest() -> None:
    weight = torch.randn(32, 64, generator=GENERATOR)
    x = torch.randn(128, 64, generator=GENERATOR)  # no outliers: little to gain
    search = search_scales(weight, moments_of(x), x.abs().mean(0), group_size=32)
    assert search.error <= search.unscaled_error


def test_scale_search_judges_scales_by_the_rounding_it_is_given() -> None:
    """Judged after error-feedback rounding, the search finds scales at least as good, under that
    rounding, as the ones round-to-nearest prefers (and far better than round-to-nearest itself)."""
    x = outlier_inputs().float()
    weight = torch.randn(64, 128, generator=GENERATOR) * 0.05
    moments, mean_abs = moments_of(x), x.abs().mean(0)
    nearest_pick = search_scales(weight, moments, mean_abs, group_size=32)
    fed_back_pick = search_scales(weight, moments, mean_abs, group_size=32, rounding=round_fed_back)
    s = nearest_pick.scales
    nearest_scales_fed_back = output_error(
        round_fed_back(weight * s, moments, s, 32) / s - weight, moments
    )
    assert fed_back_pick.error <= nearest_scales_fed_back * (1 + 1e-6)
    assert fed_back_pick.error < 0.5 * nearest_pick.error


def test_grid_search_lowers_every_groups_error_on_the_rows() -> None:
    weight = torch.randn(48, 64, generator=GENERATOR)
    weight[:, 0] *= 8  # one extreme weight per row stretches its group's range
    x = outlier_inputs(channels=64).float()
    grid = search_grid(weight, moments_of(x), group_size=32)
    assert isinstance(grid, Grid) and grid.scales.shape == grid.offsets.shape == (48, 2)
    assert grid.scales.dtype == grid.offsets.dtype == SCALE_DTYPE
    searched = quantize_int4_on_grid(weight, 32, grid.scales, grid.offsets).dequantize()
    plain = fake_quantize_int4(weight, 32)
    for g in range(2):
        cols = slice(32 * g, 32 * (g + 1))
        err = lambda q, cols=cols: ((x[:, cols] @ (q - weight)[:, cols].T) ** 2).mean(0)  # noqa: E731
        assert (err(searched) <= err(plain) * (1 + 1e-5)).all()
    assert direct_error(x, weight, searched) < 0.8 * direct_error(x, weight, plain)


def test_gqa_scales_expand_to_every_head_sharing_a_v_channel() -> None:
    per_v = torch.arange(6.0)  # 2 kv heads x head_dim 3
    expanded = _expand_kv(per_v, kv_repeat=2, head_dim=3)
    assert expanded.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert torch.equal(_reduce_kv(expanded, kv_repeat=2, head_dim=3), per_v)
    assert torch.equal(_expand_kv(per_v, kv_repeat=1, head_dim=3), per_v)


@pytest.fixture(scope="module")
def tiny_float_model(tmp_path_factory: pytest.TempPathFactory):
    path, _, _ = tiny_gguf(tmp_path_factory.mktemp("awq"))
    return lambda: build_model(open_checkpoint(path), torch.float32, "cpu", dequantize=True)


def test_folding_scales_leaves_the_float_model_unchanged(tiny_float_model) -> None:
    model = tiny_float_model()
    before = run_sequence(model, IDS)
    q_before = model.layers[0].attn.q_proj.weight.clone()
    sequences = [IDS[i : i + 16] for i in range(0, 32, 8)]
    result = apply_awq(model, sequences, group_size=32, error_feedback=False)
    assert not torch.equal(model.layers[0].attn.q_proj.weight, q_before)  # scales were folded in...
    torch.testing.assert_close(
        run_sequence(model, IDS), before, atol=1e-4, rtol=1e-4
    )  # ...without changing the function
    assert set(result.searches) == {g.linears[0] for g in scale_groups(model)}
    linears = {f"{path}.weight" for g in scale_groups(model) for path in g.linears}
    assert set(result.grids) == linears
    assert result.grids["layers.0.mlp.up_proj.weight"].scales.shape == (128, 2)


def _all_on_grid(model, grids, group_size: int) -> bool:
    for name, grid in grids.items():
        weight = model.get_submodule(name.removesuffix(".weight")).weight
        stored = quantize_int4_on_grid(weight, group_size, grid.scales, grid.offsets).dequantize()
        if not torch.equal(weight, stored):
            return False
    return True


def test_error_feedback_leaves_the_weights_on_their_grids_and_closer_to_the_float_model(
    tiny_float_model,
) -> None:
    reference = tiny_float_model()
    expected = run_sequence(reference, IDS)
    sequences = [IDS[i : i + 16] for i in range(0, 32, 8)]
    outputs = {}
    for feedback in (False, True):
        model = tiny_float_model()
        result = apply_awq(model, sequences, group_size=32, error_feedback=feedback)
        assert (
            _all_on_grid(model, result.grids, 32) == feedback
        )  # with feedback the codes live in the weights
        with _quantized(model, result.grids, 32):  # what the checkpoint holds
            outputs[feedback] = run_sequence(model, IDS)
    error = {feedback: (out - expected).pow(2).mean().item() for feedback, out in outputs.items()}
    assert error[True] < error[False], error


def test_weights_on_their_grids_are_what_the_checkpoint_stores(tiny_float_model) -> None:
    """The next layer is calibrated on the weights the checkpoint will hold, so `_quantized` must
    put each weight exactly where `quantize_int4_on_grid` decodes, and restore the float weights
    after."""
    model = tiny_float_model()
    result = apply_awq(model, [IDS[:16], IDS[16:32]], group_size=32, error_feedback=False)
    name = "layers.1.mlp.down_proj.weight"
    weight = model.get_submodule(name.removesuffix(".weight")).weight
    original = weight.clone()
    stored = quantize_int4_on_grid(
        weight, 32, result.grids[name].scales, result.grids[name].offsets
    ).dequantize()
    with _quantized(model, {name: result.grids[name]}, 32):
        assert torch.equal(weight, stored)
    assert torch.equal(weight, original)
