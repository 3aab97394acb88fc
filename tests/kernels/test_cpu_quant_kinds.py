"""The CPU kernels for GGUF's 5- and 6-bit and K-quant weight kinds, against float64 references.

Same references as test_cpu_quant_linear.py: against the activations rounded as the kernel rounds
them only float32 round-off remains; against the unrounded ones the error is activation rounding
noise. Also: a row gets the same bits alone, in a batch and in a prefill-sized call (which takes
the other schedule, quant_gemm.cpp), and the AVX2 build gives the same bits as the VNNI one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from cpu_quant_helpers import KINDS, random_activations, random_kind, require_kernels
from test_cpu_quant_linear import assert_matches

from needs import need_cpu_features
from rebar.kernels import cpu_quant
from rebar.kernels.cpu_quant.build import ISAS, cpu_flags
from suite_tiers import limit

pytestmark = limit("kernel_build")  # tests/suite_tiers.py

# (out, in): the 1 B model's attention and MLP shapes scaled down, a partial last tile, one
# super-block.
SHAPES = [(576, 512), (13, 256), (200, 1536), (64, 2048)]
ROWS = [1, 3, 4, 5, 16, 67]


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels() -> None:
    require_kernels()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_kind_matches_reference(kind: str, out_f: int, in_f: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(out_f * 3 + in_f + rows)
    case = random_kind(kind, out_f, in_f, gen)
    x = random_activations(rows, in_f, gen)
    assert_matches(cpu_quant.linear_packed(x, case.packed), x, case)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_dequantize_is_the_weight(kind: str) -> None:
    """PackedQuant.dequantize (the fallback's and the tests' view of the packed bytes) is the
    weight."""
    case = random_kind(kind, 21, 512, torch.Generator().manual_seed(1))
    assert torch.allclose(case.packed.dequantize().double(), case.dense, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_batch_invariant(kind: str) -> None:
    """A row's bits do not depend on the batch, on the schedule (32+ rows take the prefill one, on
    rebar's worker pool under 64 rows and on torch's threads from 64 on) or on the thread count."""
    gen = torch.Generator().manual_seed(7)
    case = random_kind(kind, 40, 512, gen)
    x = random_activations(70, 512, gen)
    batched = cpu_quant.linear_packed(x, case.packed)
    for i in (0, 1, 2, 3, 4, 5, 63, 64, 69):
        assert torch.equal(cpu_quant.linear_packed(x[i : i + 1], case.packed), batched[i : i + 1])
    assert torch.equal(cpu_quant.linear_packed(x[:5], case.packed), batched[:5])
    assert torch.equal(cpu_quant.linear_packed(x[:31], case.packed), batched[:31])  # small-batch
    assert torch.equal(cpu_quant.linear_packed(x[:40], case.packed), batched[:40])  # worker pool
    # The prefill schedule takes tiles two at a time on AVX-512 (pair_dots.h): 64 rows against 40
    # outputs (5 tiles) meet both the pairs and the last tile alone; one thread's share of the tiles
    # (below) cuts the pairs elsewhere.
    assert torch.equal(cpu_quant.linear_packed(x[:64], case.packed), batched[:64])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_quant.linear_packed(x, case.packed), batched)
    finally:
        torch.set_num_threads(threads)


def affine4(out_f: int, in_f: int, gen: torch.Generator, scales: torch.dtype, group: int = 32):
    """A Q4_1-like weight (kAffine, 4-bit codes) with float16 or float32 scales per `group`."""
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    groups = in_f // group
    scale = (torch.rand(out_f, groups, generator=gen) * 0.02 + 0.001).to(scales)
    offset = (torch.rand(out_f, groups, generator=gen) * -0.1).to(scales)
    return cpu_quant.pack_affine(codes, 4, scale, offset, group)


@pytest.mark.parametrize("kind", [*KINDS, "affine4", "affine4_f32", "affine4_g128"])
def test_rows_in_fours_of_tiles_are_batch_invariant(kind: str) -> None:
    """From 6 rows every kind takes four tiles against six rows at a time (four for super_sym6) on
    AVX-512 (pair_rows.cpp): every row count from there to the prefill schedule's, with full groups
    of rows and each ragged end, gives each row the bits it gets alone. 37 tiles, split into chunks
    of 9 or 10 (4 chunks a thread), leave one or two of each chunk to the small-batch kernel."""
    gen = torch.Generator().manual_seed(13)
    if kind.startswith("affine4"):
        scales = torch.float32 if kind.endswith("f32") else torch.float16
        packed = affine4(296, 512, gen, scales, 128 if kind.endswith("g128") else 32)
    else:
        packed = random_kind(kind, 296, 512, gen).packed
    x = random_activations(31, 512, gen)
    alone = torch.cat([cpu_quant.linear_packed(x[i : i + 1], packed) for i in range(31)])
    for rows in range(6, 32):
        assert torch.equal(cpu_quant.linear_packed(x[:rows], packed), alone[:rows]), rows


def test_bad_layouts_raise_value_errors() -> None:
    case = random_kind("super_sym6", 16, 256, torch.Generator().manual_seed(2))
    packed = case.packed
    x = torch.randn(2, 256)
    broken = [
        (6, 6, packed.codes, packed.scales, None, packed.sub_scales, 32, 16, 256),  # unknown kind
        (3, 5, packed.codes, packed.scales, None, packed.sub_scales, 32, 16, 256),  # wrong bits
        (3, 6, packed.codes, packed.scales, None, None, 32, 16, 256),  # no sub-scales
        (
            3,
            6,
            packed.codes,
            packed.scales,
            None,
            packed.sub_scales[:, :, :8],
            32,
            16,
            256,
        ),  # short
        (3, 6, packed.codes, packed.scales.float(), None, packed.sub_scales, 32, 16, 256),  # fp32 d
        (3, 6, packed.codes, packed.scales, None, packed.sub_scales, 32, 17, 256),  # out_features
        (3, 6, packed.codes, packed.scales, None, packed.sub_scales, 32, 16, 224),  # in_features
    ]
    for args in broken:
        with pytest.raises(ValueError):
            cpu_quant._extension().linear_packed(x, args)


def widest_isa() -> str:
    """The widest instruction set this CPU has, as the CPU reports it (REBAR_CPU_ISA aside)."""
    flags = cpu_flags()
    return next(name for name, needs, _ in ISAS if needs <= flags)


def test_avx2_build_gives_the_same_bits() -> None:
    """The AVX2 fallback (REBAR_CPU_ISA=avx2, its own build) computes every kind exactly as the
    build for this CPU's widest instruction set: the integer dots are exact either way and the float
    steps are the same."""
    wide_isa = widest_isa()
    if wide_isa == "avx2":
        need_cpu_features({"avx_vnni"}, "a VNNI build to compare the AVX2 one with")
    script = textwrap.dedent(
        """
        import json, sys
        import torch
        sys.path.insert(0, sys.argv[1])
        from cpu_quant_helpers import KINDS, random_activations, random_kind
        from rebar.kernels import cpu_quant
        out = {"isa": cpu_quant.isa()}
        for kind in KINDS + ["int4"]:
            gen = torch.Generator().manual_seed(11)
            if kind == "int4":
                codes = torch.randint(0, 16, (24, 512), generator=gen, dtype=torch.uint8)
                packed = cpu_quant.pack_affine(codes, 4, torch.full((24, 16), 0.01).half(),
                                               torch.full((24, 16), -0.08).half(), 32)
            else:
                packed = random_kind(kind, 24, 512, gen).packed
            x = random_activations(70, 512, gen)
            out[kind] = cpu_quant.linear_packed(x, packed).double().tolist()
        print(json.dumps(out))
        """
    )
    here = os.path.dirname(__file__)
    results = {}
    for isa in ("avx2", wide_isa):
        env = {**os.environ, "REBAR_CPU_ISA": isa}
        done = subprocess.run(
            [sys.executable, "-c", script, here],
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results[isa] = json.loads(done.stdout.strip().splitlines()[-1])
    (_narrow, narrow_out), (_wide, wide_out) = results.items()
    assert narrow_out.pop("isa") == "avx2" and wide_out.pop("isa") != "avx2"
    for kind in narrow_out:
        assert narrow_out[kind] == wide_out[kind], kind
