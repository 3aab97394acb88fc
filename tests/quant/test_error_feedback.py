"""Rounding with error feedback: against a direct, unblocked statement of the same updates, and
against round-to-nearest on the same grid."""

from __future__ import annotations

import torch

from rebar.quant.awq import output_error, search_grid
from rebar.quant.error_feedback import DAMPING, _inverse_cholesky, round_with_error_feedback
from rebar.weights.int_formats import INT4_MAX, onto_int4_grid

GENERATOR = torch.Generator().manual_seed(0)


def correlated_inputs(rows: int = 2048, channels: int = 128) -> torch.Tensor:
    """Inputs with a low-rank common part (correlated channels) and a few loud channels."""
    x = torch.randn(rows, 16, generator=GENERATOR) @ torch.randn(16, channels, generator=GENERATOR)
    x = x * 0.3 + 0.3 * torch.randn(rows, channels, generator=GENERATOR)
    x[:, :3] *= 10
    return x.double()


def nearest(
    weight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> torch.Tensor:
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    return onto_int4_grid(groups, scales, offsets).reshape(out_features, in_features)


def reference_rounding(
    weight: torch.Tensor,
    moments: torch.Tensor,
    scales,
    offsets,
    group_size: int,
    input_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same method written out directly: round the loudest remaining column to its nearest grid
    point, move the remaining columns by the optimal correction -e * Hinv[j, rest] / Hinv[j, j]
    using the explicit inverse of H over the columns not yet rounded, then drop column j from it.

    With `input_scales` s the weight reads x / s: H is then D^-1 (H_x + damping) D^-1, formed
    explicitly, with the columns still in order of x's energy."""
    h = moments.clone()
    h += DAMPING * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
    if input_scales is not None:
        h = h / torch.outer(input_scales, input_scales)
    inverse = torch.linalg.inv(h)
    w = weight.clone()
    column_scale = scales.double().repeat_interleave(group_size, dim=1)
    column_offset = offsets.double().repeat_interleave(group_size, dim=1)
    remaining = torch.argsort(moments.diagonal(), descending=True).tolist()
    result = torch.empty_like(w)
    while remaining:
        j, rest = remaining[0], remaining[1:]
        codes = ((w[:, j] - column_offset[:, j]) / column_scale[:, j]).round().clamp(0, INT4_MAX)
        result[:, j] = codes * column_scale[:, j] + column_offset[:, j]
        error = (w[:, j] - result[:, j]) / inverse[j, j]
        w[:, rest] -= error.unsqueeze(1) * inverse[j, rest].unsqueeze(0)
        inverse = (
            inverse - torch.outer(inverse[:, j], inverse[j, :]) / inverse[j, j]
        )  # j is now fixed
        remaining = rest
    return result


def test_matches_a_direct_statement_of_the_updates() -> None:
    x = correlated_inputs(channels=160)  # more than one block of 128 columns, groups of 32
    moments = x.T @ x / x.shape[0]
    weight = torch.randn(24, 160, generator=GENERATOR, dtype=torch.float64) * 0.05
    grid = search_grid(weight, moments.float(), 32)
    ours = round_with_error_feedback(weight, moments, grid.scales, grid.offsets, 32)
    expected = reference_rounding(weight, moments, grid.scales, grid.offsets, 32)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-9)


def test_scaled_weights_match_a_direct_statement_with_the_scaled_inputs_moments() -> None:
    """AWQ's candidates: W s reading x / s, rounded with the factor of x's moments scaled by s
    (no factorisation of their own) equal the direct updates under the scaled input's moments."""
    x = correlated_inputs(channels=160)
    moments = x.T @ x / x.shape[0]
    input_scales = x.abs().mean(0) ** 0.5
    scaled = torch.randn(24, 160, generator=GENERATOR, dtype=torch.float64) * 0.05 * input_scales
    grid = search_grid(scaled, (moments / torch.outer(input_scales, input_scales)).float(), 32)
    ours = round_with_error_feedback(
        scaled, moments, grid.scales, grid.offsets, 32, input_scales=input_scales
    )
    expected = reference_rounding(scaled, moments, grid.scales, grid.offsets, 32, input_scales)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-9)
    unscaled_factor = round_with_error_feedback(scaled, moments, grid.scales, grid.offsets, 32)
    assert not torch.equal(ours, unscaled_factor)  # the scales did reach the updates


def test_the_factor_is_the_upper_cholesky_factor_of_the_permuted_damped_inverse() -> None:
    """At widths that split unevenly into the halves the triangle is inverted by (301 -> 150 + 151
    -> ...), with a dead channel, for two orders."""
    x = correlated_inputs(channels=301)
    x[:, 7] = 0  # never fires
    h = x.T @ x / x.shape[0]
    for order in (torch.randperm(301, generator=GENERATOR), torch.arange(301)):
        upper = _inverse_cholesky(h, order)
        permuted = h[order][:, order].clone()
        diagonal = permuted.diagonal()
        diagonal[diagonal == 0] = 1.0
        diagonal += DAMPING * diagonal.mean()
        assert torch.equal(upper, upper.triu()) and bool((upper.diagonal() > 0).all())
        torch.testing.assert_close(
            upper.T @ upper @ permuted, torch.eye(301, dtype=torch.float64), rtol=0, atol=1e-9
        )


def test_every_value_stays_on_its_groups_grid() -> None:
    x = correlated_inputs()
    moments = (x.T @ x / x.shape[0]).float()
    weight = torch.randn(40, 128, generator=GENERATOR) * 0.05
    grid = search_grid(weight, moments, 64)
    rounded = round_with_error_feedback(weight, moments, grid.scales, grid.offsets, 64)
    assert rounded.dtype == torch.float32
    assert torch.equal(
        nearest(rounded, grid.scales, grid.offsets, 64), rounded
    )  # what the checkpoint stores
    assert not torch.equal(
        rounded, nearest(weight, grid.scales, grid.offsets, 64)
    )  # and codes did move


def test_cuts_the_output_error_of_nearest_rounding_on_correlated_inputs() -> None:
    x = correlated_inputs()
    moments = (x.T @ x / x.shape[0]).float()
    weight = torch.randn(64, 128, generator=GENERATOR) * 0.05
    grid = search_grid(weight, moments, 64)
    plain = output_error(nearest(weight, grid.scales, grid.offsets, 64) - weight, moments)
    fed_back = output_error(
        round_with_error_feedback(weight, moments, grid.scales, grid.offsets, 64) - weight, moments
    )
    assert fed_back < 0.5 * plain


def test_uncorrelated_inputs_leave_nothing_to_feed_back() -> None:
    """With H diagonal no other column can absorb an error: every code is the nearest one."""
    moments = torch.diag(torch.rand(64, generator=GENERATOR) + 0.5)
    weight = torch.randn(16, 64, generator=GENERATOR)
    grid = search_grid(weight, moments, 32)
    rounded = round_with_error_feedback(weight, moments, grid.scales, grid.offsets, 32)
    assert torch.equal(rounded, nearest(weight, grid.scales, grid.offsets, 32))


def test_a_channel_that_never_fires_is_rounded_without_nans() -> None:
    x = correlated_inputs(channels=64).float()
    x[:, 5] = 0
    moments = x.T @ x / x.shape[0]
    weight = torch.randn(8, 64, generator=GENERATOR)
    grid = search_grid(weight, moments, 32)
    rounded = round_with_error_feedback(weight, moments, grid.scales, grid.offsets, 32)
    assert torch.isfinite(rounded).all()
    assert torch.equal(nearest(rounded, grid.scales, grid.offsets, 32), rounded)


def test_stacked_weights_are_rounded_as_each_alone() -> None:
    """Rows are independent: a weight's first rows, rounded alone, come out as in the whole."""
    x = correlated_inputs(channels=160).float()
    moments = x.T @ x / x.shape[0]
    weight = torch.randn(24, 160, generator=GENERATOR) * 0.05
    grid = search_grid(weight, moments, 32)
    whole = round_with_error_feedback(weight, moments, grid.scales, grid.offsets, 32)
    top = round_with_error_feedback(weight[:10], moments, grid.scales[:10], grid.offsets[:10], 32)
    assert torch.equal(top, whole[:10])


def test_a_batch_is_rounded_as_each_of_its_weights_alone() -> None:
    """A batch of weights under one input, each reading it under its own scales (the scale
    search's candidates): one factorisation, the same result as each alone."""
    x = correlated_inputs(channels=160).float()
    moments = x.T @ x / x.shape[0]
    input_scales = torch.stack([x.abs().mean(0) ** alpha for alpha in (0.0, 0.3, 0.6)])
    weights = torch.randn(3, 24, 160, generator=GENERATOR) * 0.05 * input_scales[:, None]
    grids = [search_grid(w, moments / torch.outer(s, s), 32) for w, s in zip(weights, input_scales)]
    scales = torch.stack([g.scales for g in grids])
    offsets = torch.stack([g.offsets for g in grids])
    batched = round_with_error_feedback(weights, moments, scales, offsets, 32, input_scales)
    for i in range(3):
        alone = round_with_error_feedback(
            weights[i], moments, scales[i], offsets[i], 32, input_scales=input_scales[i]
        )
        torch.testing.assert_close(batched[i], alone, rtol=0, atol=0)
    assert not torch.equal(batched[1], batched[2])
