"""Packing into the kernels' tile layout (pure torch), input validation, and the availability
switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from cpu_quant_helpers import require_kernels

from rebar.kernels import cpu_quant


def unpack_int4_tiles(packed: cpu_quant.PackedQuant) -> torch.Tensor:
    """The layout documented in csrc/kernels.h, read back into codes [out, in], one byte at a time."""
    tiles, blocks = packed.codes.shape[:2]
    codes = torch.empty(tiles * 8, blocks * 32, dtype=torch.uint8)
    for tile in range(tiles):
        for block in range(blocks):
            for chunk in range(4):
                for row in range(8):
                    for j in range(4):
                        byte = int(packed.codes[tile, block, chunk, 4 * row + j])
                        codes[8 * tile + row, 32 * block + 4 * chunk + j] = byte & 0x0F
                        codes[8 * tile + row, 32 * block + 16 + 4 * chunk + j] = byte >> 4
    return codes[: packed.out_features]


def test_int4_layout_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (13, 96), generator=gen, dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.rand(13, 3, generator=gen).half()
    offsets = torch.rand(13, 3, generator=gen).half()
    packed = cpu_quant.pack_int4(qweight, scales, offsets, 32)
    assert packed.codes.shape == (2, 3, 4, 32) and packed.scales.shape == (2, 3, 8)
    assert torch.equal(unpack_int4_tiles(packed), codes)
    assert torch.equal(packed.scales.transpose(1, 2).reshape(16, 3)[:13], scales)
    assert torch.equal(packed.offsets.transpose(1, 2).reshape(16, 3)[:13], offsets)
    assert not packed.scales.transpose(1, 2).reshape(16, 3)[13:].any()  # padding rows contribute 0


def test_int8_is_stored_as_unsigned_codes_with_zero_point_128() -> None:
    """Signed int8 weights become q + 128 with zero point 128 (one layout for every kind); a
    per-channel row of 40 columns is padded to two blocks with the zero point, so the padding
    decodes to 0."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(-128, 128, (10, 40), generator=gen, dtype=torch.int8)
    scales = torch.rand(10, 1, generator=gen)
    packed = cpu_quant.pack_int8(codes, scales, 40)
    assert (
        packed.kind == cpu_quant.WeightKind.SYM
        and packed.zero_point == 128
        and packed.code_bits == 8
    )
    assert packed.codes.shape == (2, 2, 8, 32)
    stored = cpu_quant.packing.untile_codes(packed.codes, 8, 10)
    assert torch.equal(stored[:, :40].to(torch.int16) - 128, codes.to(torch.int16))
    assert (stored[:, 40:] == 128).all()
    assert torch.equal(packed.dequantize(), scales * codes.float())


def test_mixed_scale_dtypes_become_float32() -> None:
    packed = cpu_quant.pack_int4(
        torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1).half(), torch.ones(8, 1), 32
    )
    assert packed.scales.dtype == packed.offsets.dtype == torch.float32


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: cpu_quant.pack_int4(
                torch.zeros(8, 24, dtype=torch.uint8), torch.ones(8, 1), torch.ones(8, 1), 48
            ),
            "multiple of 32",
        ),
        (
            lambda: cpu_quant.pack_int4(
                torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2), torch.ones(8, 1), 32
            ),
            "offsets must have shape",
        ),
        (
            lambda: cpu_quant.pack_int4(
                torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, 1), torch.ones(8, 1), 32
            ),
            "uint8",
        ),
        (
            lambda: cpu_quant.pack_int8(
                torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1, dtype=torch.bfloat16), 64
            ),
            "float16 or float32",
        ),
        (
            lambda: cpu_quant.pack_int8(torch.zeros(8, 80, dtype=torch.int8), torch.ones(8, 2), 40),
            "multiple of 32",
        ),
    ],
)
def test_packing_rejects_bad_layouts(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_disable_switch_makes_kernels_unavailable() -> None:
    """REBAR_DISABLE_CPU_KERNELS=1: available() is False and the linear functions say why."""
    script = textwrap.dedent(
        """
        import torch
        from rebar.kernels import cpu_quant
        assert cpu_quant.available() is False
        try:
            cpu_quant.int4_linear(torch.zeros(1, 32), torch.zeros(8, 16, dtype=torch.uint8),
                                  torch.ones(8, 1), torch.zeros(8, 1), 32)
        except cpu_quant.CpuKernelsUnavailable as exc:
            assert "REBAR_DISABLE_CPU_KERNELS" in str(exc), exc
        else:
            raise AssertionError("no error")
        print("ok")
        """
    )
    env = {**os.environ, cpu_quant.DISABLE_ENV: "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_missing_requirements_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from rebar.kernels.cpu_quant import build

    monkeypatch.setattr(build, "cpu_flags", lambda: {"sse2"})
    assert "AVX2" in build.missing_requirement()
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no compiler, no ninja
    monkeypatch.delenv("CXX", raising=False)
    assert "compiler" in build.missing_requirement()


def test_cpu_flags_come_from_cpuid_when_proc_cpuinfo_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A /proc/cpuinfo without a flags line (some VMs and sandboxes) does not hide the CPU's
    instructions: CPUID answers, and for the instruction sets CPUID can tell apart it agrees with
    /proc/cpuinfo here."""
    from rebar.kernels.cpu_quant import build

    listed = build.cpu_flags()
    probed = build.cpuid_flags()
    if listed:  # both views of the same CPU agree on what they both name
        assert probed <= listed
        for flag in ("avx2", "avx512f", "avx512_vnni"):
            assert (flag in probed) == (flag in listed), flag
    real_read_text = Path.read_text

    def no_flags_line(path: Path, *args, **kwargs) -> str:
        if str(path) == "/proc/cpuinfo":
            return "processor\t: 0\nmodel name\t: a CPU that lists no flags\n"
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", no_flags_line)
    assert build.cpu_flags() == probed
    if {"avx2", "fma", "f16c"} <= listed:  # the kernels still build, for the same instructions
        assert "AVX2" not in build.missing_requirement()
        monkeypatch.delenv(build.ISA_ENV, raising=False)
        assert build.chosen_isa() == build.chosen_isa(listed) or "avx_vnni" in listed


def test_prefill_calls_share_torchs_openmp_runtime() -> None:
    """The extension's OpenMP (for at::parallel_for) is the runtime torch loaded, not a second one
    whose threads would compete with torch's for the cores."""
    require_kernels()
    script = textwrap.dedent(
        """
        import json
        import torch
        from rebar.kernels import cpu_quant
        torch.set_num_threads(2)
        packed = cpu_quant.pack_int4(torch.zeros(64, 64, dtype=torch.uint8), torch.ones(64, 4), torch.zeros(64, 4), 32)
        cpu_quant.linear_packed(torch.randn(256, 128), packed)  # a prefill-sized call: torch's pool
        print(json.dumps(sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    libraries = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(libraries) == 1 and "torch" in libraries[0], libraries


def test_packing_in_row_chunks_gives_the_same_tiles() -> None:
    """pack_in_row_chunks (how GGUF tensors are repacked, a few MiB at a time) fills the same
    tensors as packing the whole weight at once, including a partial last tile."""
    gen = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 32, (37, 512), generator=gen, dtype=torch.uint8)
    d, dmin = torch.rand(37, 2, generator=gen).half(), torch.rand(37, 2, generator=gen).half()
    sc, m = (torch.randint(0, 64, (37, 16), generator=gen, dtype=torch.uint8) for _ in range(2))

    def rows(start: int, end: int) -> cpu_quant.PackedQuant:
        return cpu_quant.pack_super_affine(
            codes[start:end], 5, d[start:end], dmin[start:end], sc[start:end], m[start:end]
        )

    whole, chunked = rows(0, 37), cpu_quant.pack_in_row_chunks(37, 16, rows)
    for name in ("codes", "scales", "offsets", "sub_scales"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert chunked.out_features == 37 and torch.equal(chunked.dequantize(), whole.dequantize())
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_quant.pack_in_row_chunks(37, 12, rows)


def test_k_quant_scale_pairs_pack_into_96_bytes_per_super_block() -> None:
    """Q4_K / Q5_K keep their 6-bit scales and mins at 6 bits: 96 bytes per tile and super-block (12
    per row, as in the GGUF file); every value survives, and 7-bit ones are refused."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (16, 512), generator=gen, dtype=torch.uint8)
    d, dmin = torch.rand(16, 2, generator=gen).half(), torch.rand(16, 2, generator=gen).half()
    sc, m = (torch.randint(0, 64, (16, 16), generator=gen, dtype=torch.uint8) for _ in range(2))
    packed = cpu_quant.pack_super_affine(codes, 4, d, dmin, sc, m)
    assert packed.sub_scales.shape == (2, 2, 96)
    scales, mins = cpu_quant.packing._unpack_k_scales(packed.sub_scales)
    assert torch.equal(cpu_quant.packing._untile(scales, 16), sc) and torch.equal(
        cpu_quant.packing._untile(mins, 16), m
    )
    with pytest.raises(ValueError, match="6-bit"):
        cpu_quant.pack_super_affine(codes, 4, d, dmin, sc | 64, m)
