"""Rounding with error feedback (GPTQ-style): choose int4 codes column by column, each column's
rounding error pushed onto the columns not yet rounded, weighted by the input's second moments.

Round-to-nearest picks every weight's code alone. But the output error of a row is
|X (q - w)|^2 = (q - w)^T H (q - w) with H = X^T X, and inputs are correlated: after rounding
column j, the rest of the row can absorb part of its error. The optimal correction for the columns
after j is -e_j * H^-1[j, j+1:] / H^-1[j, j] (Frantar et al., "GPTQ", 2022); repeating it column
after column, with the inverse's Cholesky factor standing in for the shrinking inverse, rounds the
whole row. Every code stays on its group's given grid, so the result is stored like any int4 weight.

Columns are taken in order of decreasing input energy (H's diagonal), so the channels that matter
most are rounded first, while the most columns remain to absorb their error.
"""

from __future__ import annotations

import torch

from rebar.weights.int_formats import onto_int4_grid

DAMPING = 0.01  # fraction of H's mean diagonal added to it: keeps the inverse well conditioned
# columns by decreasing input energy; False keeps their order (worse: docs/quantization.md)
ACT_ORDER = True
# columns updated together before their error is passed to the rest (same result, fewer ops)
BLOCK = 128


def _inverse_cholesky(moments: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of (H + damping)^-1, in float64."""
    h = moments.double().clone()
    diagonal = h.diagonal()
    dead = diagonal == 0  # a channel that was always zero: any value is as good
    diagonal[dead] = 1.0
    diagonal += DAMPING * diagonal.mean()
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def round_with_error_feedback(
    weight: torch.Tensor,  # [out, in]
    moments: torch.Tensor,  # [in, in], E[x^T x] of the input
    scales: torch.Tensor,  # [out, num_groups] per-group grid: w ~ scales * q + offsets, q in 0..15
    offsets: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """The weight [out, in] with every value on its group's grid, codes chosen with error feedback.
    Nearest rounding of the result onto the same grid gives back the chosen codes. Computed in
    float32 (float64 for a float64 weight)."""
    in_features = weight.shape[1]
    dtype = torch.promote_types(weight.dtype, torch.float32)
    order = (
        torch.argsort(moments.diagonal(), descending=True)
        if ACT_ORDER
        else torch.arange(in_features)
    )
    factor = _inverse_cholesky(moments[order][:, order]).to(dtype)
    # Transposed, [in, out]: a column of the weight is a contiguous row here.
    remaining = weight.to(dtype).T[order].contiguous()
    step = scales.to(dtype).T.repeat_interleave(group_size, dim=0)[order].contiguous()
    offset = offsets.to(dtype).T.repeat_interleave(group_size, dim=0)[order].contiguous()
    rounded = torch.empty_like(remaining)
    for start in range(0, in_features, BLOCK):
        end = min(start + BLOCK, in_features)
        block = remaining[start:end]  # a view: updated in place
        errors = torch.empty_like(block)
        for j in range(end - start):
            c = start + j
            rounded[c] = onto_int4_grid(block[j].unsqueeze(-1), step[c], offset[c]).squeeze(-1)
            errors[j] = (block[j] - rounded[c]) / factor[c, c]
            block[j:] -= factor[c, c:end].unsqueeze(1) * errors[j].unsqueeze(0)
        remaining[end:] -= factor[start:end, end:].T @ errors
    result = torch.empty_like(rounded)
    result[order] = rounded
    return result.T.contiguous()
