"""Activation-aware int4: recording, the scale and clip searches, and folding that leaves the float model unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from tiny_quant import IDS, tiny_gguf

from rebar.model.build import build_model
from rebar.model.loader import open_checkpoint
from rebar.quant.awq import (
    CLIP_RATIOS,
    ActivationRecorder,
    _expand_kv,
    _reduce_kv,
    apply_awq,
    record_activations,
    run_sequence,
    scale_groups,
    search_clip,
    search_scales,
)
from rebar.quant.int_formats import fake_quantize_int4

GENERATOR = torch.Generator().manual_seed(0)


def outlier_inputs(rows: int = 256, channels: int = 128) -> torch.Tensor:
    """Activations whose few large channels dominate, as in real LLMs."""
    x = torch.randn(rows, channels, generator=GENERATOR)
    x[:, :4] *= 30
    return x


def test_recorder_keeps_mean_abs_and_seeded_sample_rows() -> None:
    layer = nn.Linear(8, 3)
    calls = [torch.randn(5, 8, generator=GENERATOR) for _ in range(3)]

    def record(seed: int) -> ActivationRecorder:
        recorder = ActivationRecorder({"layer": layer}, rows_per_call=2, seed=seed)
        with recorder, torch.no_grad():
            for x in calls:
                layer(x)
        return recorder

    recorder = record(seed=1)
    everything = torch.cat(calls)
    torch.testing.assert_close(recorder.mean_abs("layer"), everything.abs().mean(0))
    samples = recorder.samples("layer")
    assert samples.shape == (6, 8)
    assert all(any(torch.equal(row, candidate) for candidate in everything) for row in samples)
    assert torch.equal(record(seed=1).samples("layer"), samples)
    assert not layer._forward_pre_hooks  # hooks are removed on exit


def test_scale_search_beats_round_to_nearest_on_outlier_channels() -> None:
    weight = torch.randn(64, 128, generator=GENERATOR) * 0.05
    x = outlier_inputs()
    search = search_scales(weight, x, x.abs().mean(0), group_size=32)
    plain = ((x @ fake_quantize_int4(weight, 32).T - x @ weight.T) ** 2).mean().item()
    assert search.rtn_error == pytest.approx(plain, rel=1e-5)  # alpha = 0 is plain round-to-nearest
    assert search.alpha > 0 and search.error < 0.7 * search.rtn_error
    assert search.scales.shape == (128,)


def test_scale_search_never_does_worse_than_round_to_nearest() -> None:
    weight = torch.randn(32, 64, generator=GENERATOR)
    x = torch.randn(128, 64, generator=GENERATOR)  # no outliers: little to gain
    search = search_scales(weight, x, x.abs().mean(0), group_size=32)
    assert search.error <= search.rtn_error


def test_clip_search_picks_ratios_that_lower_the_error() -> None:
    weight = torch.randn(48, 64, generator=GENERATOR)
    weight[:, 0] *= 8  # one extreme weight per row stretches its group's range
    x = torch.randn(128, 64, generator=GENERATOR)
    ratios = search_clip(weight, x, group_size=32)
    assert ratios.shape == (48, 2)
    assert set(ratios.unique().tolist()) <= set(torch.tensor(CLIP_RATIOS).tolist())
    assert (ratios < 1).any()

    def error(clip: torch.Tensor | float) -> float:
        return ((x @ fake_quantize_int4(weight, 32, clip).T - x @ weight.T) ** 2).mean().item()

    assert error(ratios) < error(1.0)


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
    recorder = record_activations(model, sequences, num_sample_rows=32)
    result = apply_awq(model, recorder, group_size=32)
    assert not torch.equal(model.layers[0].attn.q_proj.weight, q_before)  # scales were folded in...
    torch.testing.assert_close(run_sequence(model, IDS), before, atol=1e-4, rtol=1e-4)  # ...without changing the function
    assert set(result.searches) == {g.linears[0] for g in scale_groups(model)}
    clipped = set(result.clip_ratios)
    assert "layers.0.attn.v_proj.weight" in clipped and "layers.1.mlp.down_proj.weight" in clipped
    assert "layers.0.attn.q_proj.weight" not in clipped and "layers.0.attn.k_proj.weight" not in clipped
    assert result.clip_ratios["layers.0.mlp.up_proj.weight"].shape == (128, 2)
