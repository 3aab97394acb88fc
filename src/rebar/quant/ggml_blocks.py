"""GGUF Q4_0 / Q4_1 / Q8_0 blocks -> rebar's integer formats, without going through float.

A block holds 32 consecutive weights of one row: an fp16 scale `d` (and for Q4_1 an fp16 min `m`)
followed by the codes. Q4 blocks keep elements 0..15 in the low nibbles of their 16 bytes and 16..31
in the high nibbles. Every mapping is exact: the fp16 scales are kept as they are.
"""

from __future__ import annotations

import torch

from rebar.quant.int_formats import QuantizedWeight, pack_int4

GGML_BLOCK = 32
# type name -> bytes per block
GGML_INT_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _fp16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    # [num_blocks, 1] fp16 from the 2 bytes at `offset` of every block (little-endian, as GGUF stores it)
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16)


def _nibble_codes(quants: torch.Tensor) -> torch.Tensor:
    # [num_blocks, 16] packed -> [num_blocks, 32] codes in element order
    return torch.cat([quants & 0x0F, quants >> 4], dim=1)


def from_ggml_blocks(raw: torch.Tensor, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Decode the bytes of a 2-D GGUF tensor (`[out, in]` weights) into a QuantizedWeight with group 32."""
    if type_name not in GGML_INT_BLOCK_BYTES:
        raise ValueError(f"GGML type {type_name} has no integer mapping")
    rows, cols = shape
    block_bytes = GGML_INT_BLOCK_BYTES[type_name]
    blocks = raw.reshape(-1, block_bytes)
    num_groups = cols // GGML_BLOCK
    scales = _fp16_at(blocks, 0).reshape(rows, num_groups)
    if type_name == "Q8_0":
        codes = blocks[:, 2:34].contiguous().view(torch.int8)
        return QuantizedWeight(8, GGML_BLOCK, codes.reshape(rows, cols), scales)
    if type_name == "Q4_0":
        codes = _nibble_codes(blocks[:, 2:18])
        offsets = -8 * scales  # w = d * (q - 8); exact in fp16
    else:
        codes = _nibble_codes(blocks[:, 4:20])
        offsets = _fp16_at(blocks, 2).reshape(rows, num_groups)
    return QuantizedWeight(4, GGML_BLOCK, pack_int4(codes.reshape(rows, cols)), scales, offsets)
