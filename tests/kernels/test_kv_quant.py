"""The Q8_0 row format of the 8-bit KV cache (`rebar.kernels.kv_quant`) against llama.cpp's own
Q8_0 code in the `gguf` package (an independent implementation of the same blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from rebar.errors import InvalidRequestError
from rebar.kernels import kv_quant
from rebar.kernels.attention import KVCache


def rows(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(*shape[:-1], 1, generator=gen) * 20  # rows of very different sizes
    return torch.randn(*shape, generator=gen) * scales


def test_rows_are_llama_cpps_q8_0_blocks() -> None:
    x = rows(64, 4, 128)
    ours = kv_quant.quantize(x)
    assert ours.dtype == torch.uint8 and ours.shape == (64, 4, kv_quant.row_bytes(128)) == (
        64,
        4,
        136,
    )
    # gguf's reading of our bytes is ours: the layout is llama.cpp's.
    theirs_read = quants.dequantize(ours.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(theirs_read, kv_quant.dequantize(ours, torch.float32).numpy())
    # And gguf's writing of the same values: the same scales, the same codes but where a value sits
    # on a rounding tie (gguf rounds those away from zero, llama.cpp's x86 path and rebar to even).
    theirs = torch.from_numpy(quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0))
    ours_blocks, their_blocks = ours.view(-1, 34), theirs.view(-1, 34)
    assert torch.equal(ours_blocks[:, :2], their_blocks[:, :2])
    codes = ours_blocks[:, 2:].view(torch.int8).int() - their_blocks[:, 2:].view(torch.int8).int()
    assert codes.abs().max() <= 1 and (codes != 0).float().mean() < 1e-3


def test_round_trip_error_is_half_a_code_step() -> None:
    x = rows(32, 2, 64, seed=1)
    back = kv_quant.dequantize(kv_quant.quantize(x), torch.float32)
    blocks, back_blocks = x.view(-1, 32), back.view(-1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    # half a step, plus the float16 rounding of the scale (2^-11 relative) times a code of up to 127
    assert ((blocks - back_blocks).abs() <= step * (0.5 + 127 * 2**-11)).all()


def test_zero_rows_stay_zero() -> None:
    x = torch.zeros(3, 2, 64)
    x[1, 1, 32:] = 1.0  # one block of ones beside blocks of zeros
    back = kv_quant.dequantize(kv_quant.quantize(x), torch.float32)
    ones = torch.zeros_like(x, dtype=torch.bool)
    ones[1, 1, 32:] = True
    assert torch.equal(back[~ones], x[~ones])  # a zero scale, no 0/0
    assert torch.allclose(back[ones], x[ones], rtol=2**-11, atol=0)  # 127 codes of the half 1/127


def test_storage_helpers_follow_the_dtype() -> None:
    x = rows(5, 2, 32, seed=2)
    assert kv_quant.to_storage(x, torch.float16).dtype == torch.float16
    stored = kv_quant.to_storage(x, kv_quant.STORAGE_DTYPE)
    assert torch.equal(stored, kv_quant.quantize(x))
    assert torch.equal(
        kv_quant.from_storage(stored, torch.float32), kv_quant.dequantize(stored, torch.float32)
    )
    assert (
        kv_quant.bytes_per_row(64, torch.float16) == 128
        and kv_quant.bytes_per_row(64, torch.uint8) == 68
    )
    assert kv_quant.row_width(64, torch.float16) == 64 and kv_quant.row_width(64, torch.uint8) == 68
    names = [kv_quant.setting_name(d) for d in (torch.float16, torch.bfloat16, torch.uint8)]
    assert names == ["float16", "bfloat16", "q8_0"]  # the values `kv_cache_dtype` takes


@pytest.mark.parametrize("head_dim", [16, 40, 100])
def test_head_dims_that_are_not_whole_blocks_are_refused_naming_the_setting(head_dim: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        kv_quant.row_bytes(head_dim)
    assert info.value.param == "kv_cache_dtype"
    assert f"multiple of 32 (the Q8_0 block); this model's is {head_dim}" in str(info.value)
    with pytest.raises(InvalidRequestError):  # nor can a cache of such rows be made
        KVCache(1, 4, 4, 2, head_dim, kv_quant.STORAGE_DTYPE)
    assert kv_quant.row_bytes(64) == 68
