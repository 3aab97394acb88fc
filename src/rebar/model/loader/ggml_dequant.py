"""Dequantization of GGML block formats into torch tensors.

The common llama.cpp formats (Q8_0, Q4_0, Q4_1) are decoded here with vectorised torch ops, which
run multi-threaded and write straight into the target dtype; every other type goes through the
reference numpy decoder of the `gguf` package. Both are checked against each other in the tests.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

QK = 32  # weights per block for the 32-wide formats

# Block layouts: (bytes per block, decoder from [num_blocks, bytes] uint8 to [num_blocks, 32] float32).


def _scales(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    # [num_blocks, 1] float32 from a little-endian fp16 stored at byte `offset` of each block.
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    # 16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31.
    return torch.cat([packed & 0x0F, packed >> 4], dim=1).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _scales(blocks, 0) * blocks[:, 2:34].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _scales(blocks, 0) * (_nibbles(blocks[:, 2:18]) - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _scales(blocks, 0) * _nibbles(blocks[:, 4:20]) + _scales(blocks, 2)


_TORCH_DECODERS = {QT.Q8_0: (34, _q8_0), QT.Q4_0: (18, _q4_0), QT.Q4_1: (20, _q4_1)}

# Types whose numpy decoding in `gguf` rebar relies on (and tests).
_NUMPY_TYPES = {QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.BF16}

SUPPORTED_TYPES = frozenset({QT.F32, QT.F16} | set(_TORCH_DECODERS) | _NUMPY_TYPES)


def dequantize(data: np.ndarray, qtype: QT, dtype: torch.dtype) -> torch.Tensor:
    """Decode a GGUF tensor's data (as `GGUFReader` exposes it) into a new `dtype` tensor.

    The result has numpy's axis order (outermost first), i.e. `[out_features, in_features]` for
    a linear weight, and never shares memory with the file mapping.
    """
    if qtype in (QT.F32, QT.F16):
        return torch.from_numpy(np.array(data)).to(dtype)
    if qtype in _TORCH_DECODERS:
        block_bytes, decode = _TORCH_DECODERS[qtype]
        rows = data.shape[:-1]
        # Copy the packed bytes out of the read-only mapping (an eighth of the decoded size for Q4).
        raw = torch.from_numpy(np.array(data)).reshape(-1, block_bytes)
        values = decode(raw)  # [num_blocks, 32]
        return values.reshape(*rows, -1).to(dtype)
    if qtype in _NUMPY_TYPES:
        return torch.from_numpy(quants.dequantize(data, qtype)).to(dtype)
    raise ValueError(f"unsupported GGML type {qtype.name}")
