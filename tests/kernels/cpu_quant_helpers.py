"""Random quantized weights and float64 references for the CPU quantized-kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rebar.kernels import cpu_quant


def require_kernels() -> None:
    """Skip where the extension cannot be built; under CI=true fail instead on any CPU with AVX2."""
    # Imported here: scripts import this module with only tests/kernels on the path.
    from needs import need_cpu_kernels

    need_cpu_kernels()


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

    # int4 and int8 run as the affine and symmetric kinds, whose activation scales are float16
    half_activation_scales = True


def _expand(per_group: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    return per_group.double().repeat_interleave(group_size, dim=1)[:, :in_features]


def random_int4(
    out_f: int, in_f: int, group_size: int, dtype: torch.dtype, gen: torch.Generator
) -> QuantWeight:
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    num_groups = in_f // group_size
    scales = ((torch.rand(out_f, num_groups, generator=gen) + 0.5) * 0.01).to(dtype)
    # Like GGUF Q4_1's minimum: roughly -8 steps, so weights are centred near zero.
    offsets = (-scales.float() * (torch.rand(out_f, num_groups, generator=gen) * 4 + 6)).to(dtype)
    scaled = _expand(scales, group_size, in_f) * codes.double()
    return QuantWeight(qweight, scales, offsets, scaled, _expand(offsets, group_size, in_f))


def random_int8(
    out_f: int, in_f: int, group_size: int, dtype: torch.dtype, gen: torch.Generator
) -> QuantWeight:
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
    rounding_bound: torch.Tensor  # sum_c |w| * d_x(c) / 2: the most activation rounding can move y
    rounding_rms: (
        torch.Tensor
    )  # the typical move: rounding errors as independent uniform noise on +-d_x / 2


def reference(x: torch.Tensor, weight) -> Reference:
    """float64 references; the quantized activations come from the kernel's own quantizer. Every
    term of the kernels (the offsets' too) multiplies the rounded activations."""
    in_f = x.shape[1]
    q, d, block_sums, _ = cpu_quant.quantize_activations(
        x, group_size=32, half_scales=weight.half_activation_scales
    )
    x_hat = (q.double().reshape(len(x), -1, 32) * d.double()[..., None]).reshape(len(x), -1)[
        :, :in_f
    ]
    half_step = (d.double() / 2).repeat_interleave(32, dim=1)[:, :in_f]
    dense = weight.dense
    # An offset is one value per block of 32 and multiplies the block's rounded sum as the kernel
    # has it (float16 with half scales, as llama.cpp's Q8_1 `s`), not d * sum(q) recomputed.
    offset_terms = block_sums.double() @ weight.offset_part[:, ::32].T
    return Reference(
        exact=x.double() @ dense.T,
        same_activations=x_hat @ weight.scaled_codes.T + offset_terms,
        magnitude=x_hat.abs() @ weight.scaled_codes.abs().T
        + x_hat.abs() @ weight.offset_part.abs().T,
        rounding_bound=half_step @ dense.abs().T,
        rounding_rms=(half_step.square() @ dense.square().T / 3).sqrt(),
    )


@dataclass
class PackedCase:
    """A packed weight of one kind and its float64 parts, for `reference`."""

    name: str
    packed: cpu_quant.PackedQuant
    scaled_codes: torch.Tensor  # float64 [out, in]: scales times the codes
    offset_part: torch.Tensor  # float64 [out, in]: the offsets (or mins) expanded

    @property
    def dense(self) -> torch.Tensor:
        return self.scaled_codes + self.offset_part

    @property
    def half_activation_scales(self) -> bool:
        return self.packed.half_activation_scales


def random_kind(kind: str, out_f: int, in_f: int, gen: torch.Generator) -> PackedCase:
    """A random weight of `kind`: "sym4" / "sym5" / "sym8" (Q4_0 / Q5_0 / Q8_0), "affine5" (Q5_1),
    "super_affine4" / "super_affine5" (Q4_K / Q5_K), "super_sym6" (Q6_K), with scales of realistic
    size so outputs are O(1)."""
    bits = int(kind[-1])
    codes = torch.randint(0, 1 << bits, (out_f, in_f), generator=gen, dtype=torch.uint8)
    q = codes.double()
    if kind.startswith("sym"):
        scales = (
            (torch.rand(out_f, in_f // 32, generator=gen) + 0.5) * (0.08 / (1 << bits))
        ).half()
        zero_point = 1 << (bits - 1)
        packed = cpu_quant.pack_sym(codes, bits, scales, 32, zero_point)
        zeros = torch.zeros(out_f, in_f, dtype=torch.float64)
        return PackedCase(kind, packed, _expand(scales, 32, in_f) * (q - zero_point), zeros)
    if kind == "affine5":
        scales = ((torch.rand(out_f, in_f // 32, generator=gen) + 0.5) * 0.005).half()
        offsets = (-scales.float() * 16).half()
        packed = cpu_quant.pack_affine(codes, 5, scales, offsets, 32)
        return PackedCase(kind, packed, _expand(scales, 32, in_f) * q, _expand(offsets, 32, in_f))
    d = ((torch.rand(out_f, in_f // 256, generator=gen) + 0.5) * 3e-4).half()
    if kind.startswith("super_affine"):
        dmin = ((torch.rand(out_f, in_f // 256, generator=gen) + 0.5) * 3e-4).half()
        sc = torch.randint(0, 64, (out_f, in_f // 32), generator=gen, dtype=torch.uint8)
        m = torch.randint(0, 64, (out_f, in_f // 32), generator=gen, dtype=torch.uint8)
        packed = cpu_quant.pack_super_affine(codes, bits, d, dmin, sc, m)
        scale = _expand(d.float(), 256, in_f) * _expand(sc, 32, in_f)
        mins = _expand(dmin.float(), 256, in_f) * _expand(m, 32, in_f)
        # float32 products, as the kernel (and llama.cpp) forms them
        return PackedCase(kind, packed, scale.float().double() * q, -mins.float().double())
    sc = torch.randint(-128, 128, (out_f, in_f // 16), generator=gen, dtype=torch.int8)
    packed = cpu_quant.pack_super_sym(codes, 6, d, sc, 32)
    scale = (_expand(d.float(), 256, in_f) * _expand(sc, 16, in_f)).float().double()
    return PackedCase(kind, packed, scale * (q - 32), torch.zeros(out_f, in_f, dtype=torch.float64))


KINDS = ["sym4", "sym5", "sym8", "affine5", "super_affine4", "super_affine5", "super_sym6"]
