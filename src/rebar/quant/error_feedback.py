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
# columns updated one by one before their errors pass to the rest in one product (the same result
# up to float rounding): each column rewrites the block's later columns, so a small block moves
# less memory; 32 ran 1.5-2.5x faster than 128 on SmolLM2's shapes
BLOCK = 32


def _inverse_cholesky(moments: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factors U of (P H P^T + damping)^-1 = U^T U, float64, for H `[B, n, n]`
    with its rows and columns taken in `order` [B, n] (P).

    Without forming the inverse: with J the order-reversing permutation and J P H P^T J = L L^T,
    the factor is J L^-1 J = (J L J)^-1 (upper, positive diagonal, and U^T U = J L^-T L^-1 J =
    (P H P^T)^-1): one factorisation and one triangular inverse. J P is P in reversed order, so
    the first reversal is free.
    """
    h = _permuted(moments, order.flip(-1)).double()
    diagonal = h.diagonal(dim1=-2, dim2=-1)
    dead = diagonal == 0  # a channel that was always zero: any value is as good
    diagonal[dead] = 1.0
    diagonal += DAMPING * diagonal.mean(-1, keepdim=True)
    return _upper_inverse(torch.linalg.cholesky(h).flip(-2, -1))


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
    moments: torch.Tensor,  # [..., in, in], E[x^T x] of the input
    scales: torch.Tensor,  # [..., out, num_groups] grid: w ~ scales * q + offsets, q in 0..15
    offsets: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """The weight [..., out, in] with every value on its group's grid, codes chosen with error
    feedback. Nearest rounding of the result onto the same grid gives back the chosen codes.
    Computed in float32 (float64 for a float64 weight).

    Leading dimensions are a batch of independent roundings (each weight with its own moments),
    done together column by column: one pass of the column loop for all of them. Rows are
    independent too, so linears that read the same input can be stacked into one weight.
    """
    if weight.dim() == 2:
        return _round_batch(weight[None], moments[None], scales[None], offsets[None], group_size)[0]
    batch, shape = weight.shape[:-2], weight.shape[-2:]
    rounded = _round_batch(
        weight.reshape(-1, *shape),
        moments.reshape(-1, *moments.shape[-2:]),
        scales.reshape(-1, *scales.shape[-2:]),
        offsets.reshape(-1, *offsets.shape[-2:]),
        group_size,
    )
    return rounded.reshape(*batch, *shape)


def _select(batch: torch.Tensor, indices: torch.Tensor, dim: int) -> torch.Tensor:
    """Each matrix of `batch` [B, r, c] with its rows (dim 0) or columns (dim 1) taken in its own
    order, `indices` [B, n]. index_select along contiguous rows: a gather through a transposed
    view reads memory across rows and took several times longer."""
    return torch.stack([matrix.index_select(dim, order) for matrix, order in zip(batch, indices)])


def _columns(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[B, out, in] -> [B, in, out] with the in-columns taken in `order` [B, in] (contiguous)."""
    return _select(values, order, 1).transpose(1, 2).contiguous()


def _permuted(moments: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """P H P^T for each of the batch: rows and columns of `moments` [B, n, n] taken in `order`."""
    return _select(_select(moments, order, 0), order, 1)


def _round_batch(
    weight: torch.Tensor,
    moments: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    batch, _, in_features = weight.shape
    dtype = torch.promote_types(weight.dtype, torch.float32)
    if ACT_ORDER:
        order = torch.argsort(moments.diagonal(dim1=-2, dim2=-1), dim=-1, descending=True)
    else:
        order = torch.arange(in_features).expand(batch, in_features)
    factor = _inverse_cholesky(moments, order).to(dtype)
    pivots = factor.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)  # [B, in, 1]
    # Columns of the weight as rows, [B, in, out]: a column is contiguous here.
    remaining = _columns(weight.to(dtype), order)
    step = _columns(scales.to(dtype).repeat_interleave(group_size, dim=-1), order)
    offset = _columns(offsets.to(dtype).repeat_interleave(group_size, dim=-1), order)
    divisor = torch.where(step > 0, step, 1.0)  # a constant group: every weight is its offset
    rounded = torch.empty_like(remaining)
    for start in range(0, in_features, BLOCK):
        end = min(start + BLOCK, in_features)
        block = remaining[:, start:end]  # a view: updated in place
        errors = torch.empty_like(block)
        for j in range(end - start):
            c = start + j
            column = block[:, j]
            codes = (column - offset[:, c]).div_(divisor[:, c]).round_().clamp_(0, INT4_MAX)
            on_grid = codes.mul_(step[:, c]).add_(offset[:, c])
            rounded[:, c] = on_grid
            error = (column - on_grid).div_(pivots[:, c])
            errors[:, j] = error
            block[:, j + 1 :].sub_(factor[:, c, c + 1 : end].unsqueeze(-1) * error.unsqueeze(1))
        remaining[:, end:].sub_(factor[:, start:end, end:].transpose(1, 2) @ errors)
    # Back to the weight's layout: row i of `rounded` is input column order[i].
    return _select(rounded, torch.argsort(order, dim=-1), 0).transpose(1, 2).contiguous()
