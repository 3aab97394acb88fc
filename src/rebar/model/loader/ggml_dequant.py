"""Dequantization of GGUF tensors into torch tensors (the float path: `--dequantize`, norms,
biases).

Block formats go through rebar's own decoders (`rebar.weights.block_weight`, vectorised torch ops
that agree bit for bit with llama.cpp's and the `gguf` package's); BF16 goes through `gguf`'s
numpy reader. Both are checked against `gguf` in the tests.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from rebar.weights.block_weight import BLOCK_LAYOUTS, decode_blocks

BLOCK_TYPES = frozenset(QT[name] for name in BLOCK_LAYOUTS)
SUPPORTED_TYPES = frozenset({QT.F32, QT.F16, QT.BF16} | BLOCK_TYPES)


def dequantize(data: np.ndarray, qtype: QT, dtype: torch.dtype) -> torch.Tensor:
    """Decode a GGUF tensor's data (as `GGUFReader` exposes it) into a new `dtype` tensor.

    The result has numpy's axis order (outermost first), i.e. `[out_features, in_features]` for
    a linear weight, and never shares memory with the file mapping.
    """
    if qtype in (QT.F32, QT.F16):
        return torch.from_numpy(np.array(data)).to(dtype)
    if qtype in BLOCK_TYPES:
        rows = data.shape[:-1]
        # Copy the packed bytes out of the read-only mapping (an eighth of the decoded size for Q4).
        raw = torch.from_numpy(np.array(data)).reshape(-1, data.shape[-1])
        return decode_blocks(qtype.name, raw).dequantize().reshape(*rows, -1).to(dtype)
    if qtype == QT.BF16:
        return torch.from_numpy(quants.dequantize(data, qtype)).to(dtype)
    raise ValueError(f"unsupported GGML type {qtype.name}")
