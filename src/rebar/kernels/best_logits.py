"""Each row's best logit: the greedy token and whether the row can be trusted, in one pass.

torch's `argmax` tracks indices without vectorising: on Gemma 3's 262,144-token rows it takes
about 0.3-0.45 ms a row on this machine, 20 times `amax`, and greedy decoding pays it on every row
of every step (a verification step scores several). The compiled pass (csrc/elementwise.cpp
`best_logit`) finds the first largest value and notes NaN and infinities in the same sweep. Like
`token_mask`, nothing here builds the extension: it is used once this process has loaded it; the
torch reference runs otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from rebar.kernels.cpu_quant.build import loaded_extension


class BestTokens(NamedTuple):
    """Each row's greedy token and whether the row can be trusted (see `best_logits`)."""

    token_ids: torch.Tensor  # int64 [rows]
    valid: torch.Tensor  # bool [rows]

    @classmethod
    def cat(cls, parts: Sequence[BestTokens]) -> BestTokens:
        """The rows of `parts`, in order."""
        return cls(
            torch.cat([p.token_ids for p in parts]) if parts else torch.empty(0, dtype=torch.long),
            torch.cat([p.valid for p in parts]) if parts else torch.empty(0, dtype=torch.bool),
        )


def best_logits(logits: torch.Tensor) -> BestTokens:
    """For logits [rows, vocab]: (int64 [rows] the index of each row's first largest value, bool
    [rows] whether that value is finite and the row holds no NaN). Where the second is False the
    first is some index in [0, vocab): callers must not use it."""
    extension = loaded_extension()
    if (
        extension is not None
        and logits.dtype == torch.float32
        and logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.shape[1] > 0
    ):
        return BestTokens(*extension.best_logits(logits))
    return reference_best_logits(logits)


def reference_best_logits(logits: torch.Tensor) -> BestTokens:
    """The same in torch, on any device (amax propagates NaN, so one check covers both)."""
    return BestTokens(logits.argmax(-1), torch.isfinite(logits.amax(-1)))
