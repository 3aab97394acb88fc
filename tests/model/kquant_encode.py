"""A plain round-to-nearest encoder for GGUF's Q4_K, Q5_K and Q6_K blocks, for test files.

The `gguf` package decodes K-quants but cannot make them. This writes valid blocks in llama.cpp's
byte layout (ggml-common.h) with simple per-sub-block ranges (not llama.cpp's error search): the
tests decode them with `gguf` itself, so the layout is checked independently of rebar's decoders.
"""

from __future__ import annotations

import numpy as np

SUPER = 256


def _round(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5)


def _six_bit_pairs(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[n, 8] scales and mins 0..63 -> [n, 12] bytes (the inverse of llama.cpp's get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _affine_k(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """[n, 256] -> (codes [n, 256], d [n], dmin [n], sc [n, 8], m [n, 8]) for w = d sc q - dmin m."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)
    high = sub.max(axis=-1)
    step = (high - low) / levels
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = (-low.min(axis=1) / 63).astype(np.float16)  # low <= 0: the largest min
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(_round(step / np.where(d32 > 0, d32, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(_round(-low / np.where(dmin32 > 0, dmin32, 1)[:, None]), 0, 63).astype(np.uint8)
    scale = (d32[:, None] * sc)[..., None]
    offset = (dmin32[:, None] * m)[..., None]
    codes = np.clip(_round((sub + offset) / np.where(scale > 0, scale, 1)), 0, levels).astype(
        np.uint8
    )
    return codes.reshape(-1, SUPER), d, dmin, sc, m


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _low_nibbles_k(codes: np.ndarray) -> np.ndarray:
    """[n, 256] codes -> [n, 128] bytes: per 64 values, value l in the low nibble of byte l, 32 + l
    high."""
    chunks = codes.reshape(-1, 4, 2, 32) & 0x0F
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    codes, d, dmin, sc, m = _affine_k(blocks, 15)
    return np.concatenate(
        [_fp16_bytes(d), _fp16_bytes(dmin), _six_bit_pairs(sc, m), _low_nibbles_k(codes)], axis=1
    )


def encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    codes, d, dmin, sc, m = _affine_k(blocks, 31)
    high = (codes.reshape(-1, 8, 32) >> 4) & 1  # [n, sub-block s, l]: bit s of qh[l]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    return np.concatenate(
        [_fp16_bytes(d), _fp16_bytes(dmin), _six_bit_pairs(sc, m), qh, _low_nibbles_k(codes)],
        axis=1,
    )


def encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=-1) / 31
    d = (step.max(axis=1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    sc = np.clip(_round(step / np.where(d32 > 0, d32, 1)[:, None]), -128, 127).astype(np.int8)
    scale = (d32[:, None] * sc)[..., None]
    q = (
        np.clip(_round(sub / np.where(scale > 0, scale, 1)) + 32, 0, 63)
        .astype(np.uint8)
        .reshape(-1, 2, 4, 32)
    )
    # per half of 128 values: q[k] = values 32k + l, k = 0..3
    ql = np.concatenate(
        [
            (q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
            (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4),
        ],
        axis=2,
    ).reshape(-1, 128)
    qh = (
        (q[:, :, 0] >> 4)
        | ((q[:, :, 1] >> 4) << 2)
        | ((q[:, :, 2] >> 4) << 4)
        | ((q[:, :, 3] >> 4) << 6)
    )
    return np.concatenate(
        [
            ql.astype(np.uint8),
            qh.reshape(-1, 64).astype(np.uint8),
            sc.view(np.uint8),
            _fp16_bytes(d),
        ],
        axis=1,
    )


ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}


def encode_k(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 `[..., cols]` (cols a multiple of 256) -> uint8 `[..., cols // 256 * block bytes]`."""
    rows = values.reshape(-1, values.shape[-1]).astype(np.float32)
    blocks = ENCODERS[type_name](rows.reshape(-1, SUPER))
    return blocks.reshape(*values.shape[:-1], -1)
