"""How often rebar's next-token pick is llama.cpp's, over teacher-forced fixtures of llama.cpp's top 5
after every prefix (tests/fixtures/*_llamacpp*.json)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def top1_agreement(
    cases: Sequence[dict], logits: Sequence[torch.Tensor], values_key: str, decisive_margin: float
) -> tuple[int, int, int, int]:
    """(positions where rebar's argmax is llama.cpp's top-1, positions, the same counted only where
    llama.cpp's own top two are at least `decisive_margin` apart, such positions). Each case holds
    "top5_ids" and, under `values_key`, llama.cpp's 5 values in its order (logits or
    log-probabilities: only their gaps count)."""
    agree = total = decisive_agree = decisive_total = 0
    for case, rows in zip(cases, logits, strict=True):
        predicted = rows.argmax(-1).tolist()
        assert len(predicted) == len(case["top5_ids"])
        for ours, ids, values in zip(predicted, case["top5_ids"], case[values_key]):
            total += 1
            agree += ours == ids[0]
            if values[0] - values[1] >= decisive_margin:
                decisive_total += 1
                decisive_agree += ours == ids[0]
    return agree, total, decisive_agree, decisive_total
