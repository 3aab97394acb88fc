"""GGUF Q4_0 / Q4_1 / Q8_0 blocks map exactly onto rebar's integer formats (gguf's numpy decoder is the reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from rebar.quant.ggml_blocks import from_ggml_blocks


@pytest.mark.parametrize(("qtype", "bits"), [(QT.Q4_0, 4), (QT.Q4_1, 4), (QT.Q8_0, 8)], ids=lambda v: getattr(v, "name", v))
def test_blocks_decode_exactly_like_gguf(qtype: QT, bits: int) -> None:
    values = np.random.default_rng(3).standard_normal((6, 96)).astype(np.float32)
    raw = quants.quantize(values, qtype)
    weight = from_ggml_blocks(torch.from_numpy(raw.copy()), qtype.name, (6, 96))
    assert (weight.bits, weight.group_size, weight.num_groups) == (bits, 32, 3)
    assert torch.equal(weight.dequantize(), torch.from_numpy(quants.dequantize(raw, qtype)))


def test_unknown_type_is_refused() -> None:
    with pytest.raises(ValueError, match="Q5_0"):
        from_ggml_blocks(torch.zeros(22, dtype=torch.uint8), "Q5_0", (1, 32))
