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

from rebar.weights.int_formats import INT4_MAX

DAMPING = 0.01  # fraction of H's mean diagonal added to it: keeps the inverse well conditioned
# columns by decreasing input energy; False keeps their order (worse: docs/quantization.md)
ACT_ORDER = True
# columns rounded one by one before their errors pass to the rest in one product (the same result
# up to float rounding); within a block, each column takes the corrections of the ones before it
# when its turn comes (a matrix-vector product over their errors)
BLOCK = 32


def _inverse_cholesky(moments: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of (P H P^T + damping)^-1 = U^T U, float64, for H `[n, n]` with its
    rows and columns taken in `order` [n] (P).

    Without forming the inverse: with J the order-reversing permutation and J P H P^T J = L L^T,
    the factor is J L^-1 J = (J L J)^-1 (upper, positive diagonal, and U^T U = J L^-T L^-1 J =
    (P H P^T)^-1): one factorisation and one triangular inverse. J P is P in reversed order, so
    the first reversal is free.
    """
    reversed_order = order.flip(0)
    h = moments.index_select(0, reversed_order).index_select(1, reversed_order).double()
    diagonal = h.diagonal()
    dead = diagonal == 0  # a channel that was always zero: any value is as good
    diagonal[dead] = 1.0
    diagonal += DAMPING * diagonal.mean()
    return _upper_inverse(torch.linalg.cholesky(h).flip(0, 1))


def _upper_inverse(upper: torch.Tensor, leaf: int = 128) -> torch.Tensor:
    """The inverse of upper-triangular matrices [..., n, n], by halves: [[A, B], [0, C]]^-1 =
    [[A^-1, -A^-1 B C^-1], [0, C^-1]]. A third of the arithmetic of solving against the
    identity, which does not know the result is triangular (10 x 1536^2: 0.36 s against 0.62 s)."""
    n = upper.shape[-1]
    if n <= leaf:
        eye = torch.eye(n, dtype=upper.dtype, device=upper.device).expand_as(upper)
        return torch.linalg.solve_triangular(upper, eye, upper=True)
    half = n // 2
    first = _upper_inverse(upper[..., :half, :half], leaf)
    last = _upper_inverse(upper[..., half:, half:], leaf)
    inverse = torch.zeros_like(upper)
    inverse[..., :half, :half] = first
    inverse[..., half:, half:] = last
    inverse[..., :half, half:] = -(first @ upper[..., :half, half:]) @ last
    return inverse


def round_with_error_feedback(
    weight: torch.Tensor,  # [..., out, in]
    moments: torch.Tensor,  # [in, in], E[x^T x] of the input x
    scales: torch.Tensor,  # [..., out, num_groups] grid: w ~ scales * q + offsets, q in 0..15
    offsets: torch.Tensor,
    group_size: int,
    input_scales: torch.Tensor | None = None,  # [..., in]: the weight reads x / input_scales
) -> torch.Tensor:
    """The weight [..., out, in] with every value on its group's grid, codes chosen with error
    feedback. Nearest rounding of the result onto the same grid gives back the chosen codes.
    Computed in float32 (float64 for a float64 weight).

    Leading dimensions are a batch of roundings under the same input, done together column by
    column: one factorisation of the moments and one pass of the column loop for all of them.
    Rows are independent, so linears that read the same input can be stacked into one weight.

    With `input_scales` s (AWQ's scaled weight W s, whose input is x / s), the input's moments are
    D^-1 H D^-1 (D = diag(s), H = `moments`), with the columns' order and the damping still taken
    from H. Then the factor needs no factorisation of its own: if U^T U = (H + damping)^-1, then
    (U D)^T (U D) = D (H + damping)^-1 D = (D^-1 (H + damping) D^-1)^-1, so weights scaled by
    different s (the candidates of a scale search) share H's one factor, each with its columns
    multiplied by its s.
    """
    shape = weight.shape
    rounded = _round_batch(
        weight.reshape(-1, *shape[-2:]),
        moments,
        scales.reshape(-1, *scales.shape[-2:]),
        offsets.reshape(-1, *offsets.shape[-2:]),
        group_size,
        None if input_scales is None else input_scales.reshape(-1, shape[-1]),
    )
    return rounded.reshape(shape)


def _round_batch(
    weight: torch.Tensor,  # [B, out, in]
    moments: torch.Tensor,  # [in, in]
    scales: torch.Tensor,  # [B, out, num_groups]
    offsets: torch.Tensor,
    group_size: int,
    input_scales: torch.Tensor | None,  # [B or 1, in]
) -> torch.Tensor:
    batch, out_features, in_features = weight.shape
    dtype = torch.promote_types(weight.dtype, torch.float32)
    if ACT_ORDER:
        order = torch.argsort(moments.diagonal(), descending=True)
    else:
        order = torch.arange(in_features, device=moments.device)
    factor = _inverse_cholesky(moments, order).to(dtype)[None]  # [1, in, in]
    if input_scales is not None:  # U D, D in the columns' order (the docstring above)
        factor = factor * input_scales.to(dtype)[:, None, order]
    factor = factor.expand(batch, -1, -1)
    pivots = factor.diagonal(dim1=-2, dim2=-1).contiguous()  # [B, in]
    # The weight's columns as rows, in the order they are rounded: [B, in, out], each contiguous.
    remaining = weight.to(dtype).transpose(1, 2)[:, order].contiguous()
    # A column's grid is its group's row of these [B, num_groups, out]: no copy per column.
    steps = scales.to(dtype).transpose(1, 2).contiguous()
    bases = offsets.to(dtype).transpose(1, 2).contiguous()
    divisors = torch.where(steps > 0, steps, 1.0)  # a constant group: every weight is its offset
    columns, groups = order.tolist(), (order // group_size).tolist()
    # Rows in the weight's column order: each rounded column lands at its own place.
    rounded = remaining.new_empty(batch, in_features, out_features)
    for start in range(0, in_features, BLOCK):
        end = min(start + BLOCK, in_features)
        block = remaining[:, start:end]
        errors = torch.empty_like(block)
        for j in range(end - start):
            c, g = start + j, groups[start + j]
            column = block[:, j]
            if j:  # the corrections from the block's columns before it
                corrections = factor[:, start:c, c].unsqueeze(1)  # [B, 1, j]
                column = torch.baddbmm(block[:, j : j + 1], corrections, errors[:, :j], alpha=-1)
                column = column[:, 0]
            codes = (column - bases[:, g]).div_(divisors[:, g]).round_().clamp_(0, INT4_MAX)
            on_grid = codes.mul_(steps[:, g]).add_(bases[:, g])
            rounded[:, columns[c]] = on_grid
            errors[:, j] = (column - on_grid).div_(pivots[:, c : c + 1])
        remaining[:, end:].sub_(factor[:, start:end, end:].transpose(1, 2) @ errors)
    return rounded.transpose(1, 2).contiguous()
