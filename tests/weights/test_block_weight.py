"""GGUF block formats decode exactly as llama.cpp does (gguf's numpy decoder is the reference), and
a BlockWeight's row views (reordering, slicing, lookups) pick the right rows without copying the
file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QT

from rebar.weights.block_weight import BLOCK_LAYOUTS, BlockWeight, decode_blocks

TYPES = [QT[name] for name in BLOCK_LAYOUTS]
# byte offsets of the float16 fields of each block (random bytes there could be inf or NaN)
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_raw(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random block bytes (every nibble, sign and high bit) with finite scales: [rows, row bytes]."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype.name]:
        scales = (rng.standard_normal((rows, cols // per_block)) * 0.05).astype(np.float16)
        raw[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def test_every_block_type_is_covered() -> None:
    assert set(FP16_FIELDS) == set(BLOCK_LAYOUTS)
    for name, (block_bytes, per_block) in BLOCK_LAYOUTS.items():
        assert GGML_QUANT_SIZES[QT[name]] == (per_block, block_bytes)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_decoding_matches_gguf_bit_for_bit(qtype: QT) -> None:
    raw = random_raw(qtype, rows=6, cols=512)
    decoded = decode_blocks(qtype.name, torch.from_numpy(raw.copy()))
    expected = torch.from_numpy(quants.dequantize(raw, qtype))
    assert torch.equal(decoded.dequantize(), expected)
    bits = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}[
        qtype.name
    ]
    assert decoded.bits == bits
    if decoded.kind != "int8":
        assert int(decoded.codes.max()) < 2**bits and int(decoded.codes.max()) >= 2 ** (
            bits - 1
        )  # high bits used


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.Q6_K], ids=lambda q: q.name)
def test_row_views(qtype: QT) -> None:
    raw = torch.from_numpy(random_raw(qtype, rows=10, cols=256, seed=1).copy())
    weight = BlockWeight(qtype.name, raw, 256)
    full = weight.dequantize()
    assert (weight.out_features, weight.in_features, weight.describe()) == (10, 256, qtype.name)
    order = torch.tensor([3, 1, 4, 0, 9, 2, 6, 5, 8, 7])
    reordered = weight.select_rows(order)
    assert reordered.raw is raw, "reordering rows must not copy the bytes"
    assert torch.equal(reordered.dequantize(), full[order])
    assert torch.equal(reordered.row_slice(2, 5).dequantize(), full[order[2:5]])
    assert torch.equal(
        reordered.select_rows(torch.tensor([1, 0])).dequantize(), full[order[[1, 0]]]
    )
    lookup = torch.tensor([7, 7, 0])
    assert torch.equal(reordered.dequantize_rows(lookup, torch.float16), full[order[lookup]].half())
    assert torch.equal(weight.row_slice(4, 10).dequantize(), full[4:10])


def test_mismatched_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="Q4_K rows of 256 values take 144 bytes"):
        BlockWeight("Q4_K", torch.zeros(2, 140, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="Q4_K rows"):
        BlockWeight("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 200)
    with pytest.raises(ValueError, match="IQ4_XS is not a block format"):
        BlockWeight("IQ4_XS", torch.zeros(2, 136, dtype=torch.uint8), 256)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_packing_for_the_cpu_kernels_keeps_every_value(qtype: QT) -> None:
    """Random bytes (every code, sign, 6-bit scale and high bit) survive repacking into the kernels'
    tiles exactly, with a partial last tile of output rows."""
    from rebar.weights.qlinear import pack_for_cpu

    weight = BlockWeight(
        qtype.name, torch.from_numpy(random_raw(qtype, rows=13, cols=512, seed=2).copy()), 512
    )
    assert torch.equal(pack_for_cpu(weight).dequantize(), weight.dequantize())
