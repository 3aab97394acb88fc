"""Random quantized weights and float64 references for the CPU quantized-kernel tests."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from rebar.kernels import cpu_quant
from rebar.kernels.cpu_quant.build import cpu_flags, load_extension


def require_kernels() -> None:
    """Skip where the extension cannot be built; under CI=true fail instead on any CPU with AVX2.

    CI machines have AVX2 and install a compiler and ninja, so a CI run must never pass by skipping.
    """
    if cpu_quant.available():
        return
    reason = load_extension().reason
    if os.environ.get("CI", "").lower() == "true" and {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.fail(f"CI requires rebar's CPU kernels on this AVX2 machine: {reason}", pytrace=False)
    pytest.skip(f"rebar CPU kernels unavailable: {reason}")


@dataclass
class QuantWeight:
    qweight: torch.Tensor  # the raw layout the API takes
    scales: torch.Tensor
    offsets: torch.Tensor | None  # int4 only
    scaled_codes: torch.Tensor  # float64 [out, in]: scales * q
    offset_part: torch.Tensor  # float64 [out, in]: the expanded offsets (zeros for int8)

    @property
    def dense(self) -> torch.Tensor:
        return self.scaled_codes + self.offset_part


def _expand(per_group: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    return per_group.double().repeat_interleave(group_size, dim=1)[:, :in_features]


def random_int4(out_f: int, in_f: int, group_size: int, dtype: torch.dtype, gen: torch.Generator) -> QuantWeight:
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    num_groups = in_f // group_size
    scales = ((torch.rand(out_f, num_groups, generator=gen) + 0.5) * 0.01).to(dtype)
    # Like GGUF Q4_1's minimum: roughly -8 steps, so weights are centred near zero.
    offsets = (-scales.float() * (torch.rand(out_f, num_groups, generator=gen) * 4 + 6)).to(dtype)
    scaled = _expand(scales, group_size, in_f) * codes.double()
    return QuantWeight(qweight, scales, offsets, scaled, _expand(offsets, group_size, in_f))


def random_int8(out_f: int, in_f: int, group_size: int, dtype: torch.dtype, gen: torch.Generator) -> QuantWeight:
    codes = torch.randint(-128, 128, (out_f, in_f), generator=gen, dtype=torch.int8)
    scales = ((torch.rand(out_f, in_f // group_size, generator=gen) + 0.5) * 1e-3).to(dtype)
    scaled = _expand(scales, group_size, in_f) * codes.double()
    return QuantWeight(codes, scales, None, scaled, torch.zeros_like(scaled))


def random_activations(rows: int, in_f: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, in_f, generator=gen)
    x[:, in_f // 3] *= 20  # an outlier feature, as real hidden states have
    return x


@dataclass
class Reference:
    exact: torch.Tensor  # x @ w.T in float64
    same_activations: torch.Tensor  # the same with x rounded as the kernel rounds it
    magnitude: torch.Tensor  # sum over c of |each term|: the scale of float32 round-off
    rounding_bound: torch.Tensor  # sum_c |scales * q| * d_x(c) / 2: the most activation rounding can move y
    rounding_rms: torch.Tensor  # the typical move: rounding errors as independent uniform noise on +-d_x / 2


def reference(x: torch.Tensor, weight: QuantWeight) -> Reference:
    """float64 references; the quantized activations come from the kernel's own quantizer."""
    in_f = x.shape[1]
    q, d, _ = cpu_quant.quantize_activations(x)
    x_hat = (q.double().reshape(len(x), -1, 32) * d.double()[..., None]).reshape(len(x), -1)[:, :in_f]
    half_step = (d.double() / 2).repeat_interleave(32, dim=1)[:, :in_f]
    xd = x.double()
    return Reference(
        exact=xd @ weight.dense.T,
        same_activations=x_hat @ weight.scaled_codes.T + xd @ weight.offset_part.T,
        magnitude=x_hat.abs() @ weight.scaled_codes.abs().T + xd.abs() @ weight.offset_part.abs().T,
        rounding_bound=half_step @ weight.scaled_codes.abs().T,
        rounding_rms=(half_step.square() @ weight.scaled_codes.square().T / 3).sqrt(),
    )
