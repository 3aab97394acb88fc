"""The Triton decode attention kernel, run on Triton's CPU interpreter, against the torch reference.

Every step scatters each sequence's context over shuffled KV blocks; every slot outside a context
holds NaN, so a kernel that reads past a context, or through block-table padding, fails. The
reference is `paged_attention` in float64 on the same data.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from interpreted_triton import import_interpreted

from rebar.kernels import backends, kv_quant
from rebar.kernels.attention import AttentionMetadata, pad_block_tables, paged_attention, write_kv
from rebar.kernels.attention_batched import batched_paged_attention


@pytest.fixture(scope="module")
def kernels() -> ModuleType | None:
    """The kernel module, interpreted; None when the tests must run in a subprocess (conftest.py)."""
    return import_interpreted("rebar.kernels.triton_attention")


@dataclass
class Step:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    meta: AttentionMetadata

    def run(
        self,
        backend: Callable[..., torch.Tensor],
        sliding_window: int | None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """`backend` on copies of this step's tensors (converted to `dtype` when given)."""
        tensors = [t.clone() if dtype is None else t.to(dtype) for t in (self.q, self.k, self.v)]
        caches = [
            c.clone() if dtype is None else c.to(dtype) for c in (self.key_cache, self.value_cache)
        ]
        return backend(*tensors, *caches, self.meta, self.head_dim**-0.5, sliding_window)

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]


def make_step(
    specs: list[tuple[int, int]],  # (query_len, context_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Step:
    """Random K/V for the cached part of each context, NaN everywhere else, shuffled blocks.

    Block 0 is never handed out: it is the block tables' padding value, so padding points at NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-context_len // block_size) for _, context_len in specs) + 4
    pool = list(range(1, num_blocks))
    random.Random(seed).shuffle(pool)
    key_cache = torch.full(
        (num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )
    value_cache = key_cache.clone()
    flat_keys, flat_values = (
        key_cache.view(-1, num_kv_heads, head_dim),
        value_cache.view(-1, num_kv_heads, head_dim),
    )
    tables, new_slots = [], []
    for query_len, context_len in specs:
        table = [pool.pop() for _ in range(-(-context_len // block_size))]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(context_len)]
        )
        num_cached = context_len - query_len
        flat_keys[slots[:num_cached]] = torch.randn(
            num_cached, num_kv_heads, head_dim, generator=gen
        ).to(dtype)
        flat_values[slots[:num_cached]] = torch.randn(
            num_cached, num_kv_heads, head_dim, generator=gen
        ).to(dtype)
        tables.append(table)
        new_slots.append(slots[num_cached:])
    num_tokens = sum(query_len for query_len, _ in specs)
    meta = AttentionMetadata(
        query_lens=tuple(query_len for query_len, _ in specs),
        context_lens=tuple(context_len for _, context_len in specs),
        slot_mapping=torch.cat([torch.empty(0, dtype=torch.long), *new_slots]),
        block_tables=torch.cat(
            [pad_block_tables(tables), torch.zeros(len(specs), 2, dtype=torch.long)], dim=1
        ),
    )

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return Step(
        randn(num_tokens, num_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim),
        randn(num_tokens, num_kv_heads, head_dim), key_cache, value_cache, meta,
    )  # fmt: skip


def reference(step: Step, sliding_window: int | None) -> torch.Tensor:
    return step.run(paged_attention, sliding_window, dtype=torch.float64)


def decode_with_partitions(
    kernels: ModuleType, tokens_per_partition: int
) -> Callable[..., torch.Tensor]:
    """The decode kernel as a backend, with partitions of the given length."""

    def backend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, sliding_window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        tables, lens = meta.block_tables, meta.context_lens
        return kernels.paged_decode_attention(
            q, key_cache, value_cache, tables, lens, scale, sliding_window, tokens_per_partition
        )

    return backend


# Odd lengths, exact block multiples, a one-token context, and one long enough for many partitions.
DECODE_LENS = [1, 17, 33, 16, 50, 95]


@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("tokens_per_partition", [512, 32])
def test_gqa_decode_matches_reference(
    kernels: ModuleType, sliding_window: int | None, tokens_per_partition: int
) -> None:
    """8 query / 2 kv heads, block size 16; 32 tokens per partition splits the longest context in 3."""
    step = make_step(
        [(1, n) for n in DECODE_LENS], num_heads=8, num_kv_heads=2, block_size=16, head_dim=32
    )

    out = step.run(decode_with_partitions(kernels, tokens_per_partition), sliding_window)
    assert out.shape == step.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(step, sliding_window), atol=1e-5, rtol=0)


def test_backend_entry_point_on_a_decode_step(kernels: ModuleType) -> None:
    step = make_step(
        [(1, n) for n in DECODE_LENS],
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        head_dim=32,
        seed=1,
    )
    out = step.run(kernels.triton_paged_attention, 20)
    torch.testing.assert_close(out.double(), reference(step, 20), atol=1e-5, rtol=0)


def test_sizes_that_are_not_powers_of_two(kernels: ModuleType) -> None:
    """Block size 5, head dim 20, 3 query heads per kv head, a window of 7, 2 blocks per partition."""
    step = make_step(
        [(1, n) for n in (1, 4, 5, 12, 23)], num_heads=6, num_kv_heads=2, block_size=5, head_dim=20
    )

    for sliding_window in (None, 7):
        out = step.run(decode_with_partitions(kernels, 10), sliding_window)
        torch.testing.assert_close(out.double(), reference(step, sliding_window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches(kernels: ModuleType, dtype: torch.dtype) -> None:
    specs = [(1, n) for n in (3, 40, 71)]
    step = make_step(specs, num_heads=8, num_kv_heads=2, block_size=16, head_dim=32, dtype=dtype)
    out = step.run(kernels.triton_paged_attention, None)
    assert out.dtype == dtype
    # Outputs of size ~1: one bf16 ulp is 2^-7 (the interpreter truncates when narrowing), fp16's
    # 2^-10.
    atol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.double(), reference(step, None), atol=atol, rtol=0)


@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("tokens_per_partition", [512, 32])
def test_q8_0_caches_are_read_in_place(
    kernels: ModuleType, sliding_window: int | None, tokens_per_partition: int
) -> None:
    """Q8_0 rows (a float16 scale and 32 int8 codes per block; NaN scales outside the contexts)
    read as the torch backend reads them, which tests/kernels/test_attention.py checks against a
    dense reference."""
    step = make_step(
        [(1, n) for n in DECODE_LENS], num_heads=8, num_kv_heads=2, block_size=16, head_dim=64
    )
    step.key_cache = kv_quant.quantize(step.key_cache)
    step.value_cache = kv_quant.quantize(step.value_cache)
    out = step.run(decode_with_partitions(kernels, tokens_per_partition), sliding_window)
    expected = step.run(batched_paged_attention, sliding_window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_new_keys_and_values_land_in_the_cache(kernels: ModuleType) -> None:
    step = make_step(
        [(1, n) for n in (5, 18)], num_heads=4, num_kv_heads=2, block_size=16, head_dim=16
    )
    expected_keys, expected_values = step.key_cache.clone(), step.value_cache.clone()
    slots = step.meta.slot_mapping
    expected_keys.view(-1, 2, 16)[slots] = step.k
    expected_values.view(-1, 2, 16)[slots] = step.v
    scale = step.head_dim**-0.5
    kernels.triton_paged_attention(
        step.q, step.k, step.v, step.key_cache, step.value_cache, step.meta, scale, None
    )
    torch.testing.assert_close(step.key_cache, expected_keys, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(step.value_cache, expected_values, rtol=0, atol=0, equal_nan=True)


def test_steps_with_a_prompt_go_to_the_batched_backend(kernels: ModuleType) -> None:
    """Prefill, a chunk after a cached prefix and decode rows in one step: the torch path,
    unchanged."""
    specs = [(1, 33), (7, 7), (4, 38), (1, 16), (16, 48)]
    step = make_step(specs, num_heads=8, num_kv_heads=2, block_size=16, head_dim=16)
    out = step.run(kernels.triton_paged_attention, 20)
    assert torch.equal(out, step.run(batched_paged_attention, 20))
    torch.testing.assert_close(out.double(), reference(step, 20), atol=1e-5, rtol=0)


def test_a_step_without_sequences_gives_an_empty_output(kernels: ModuleType) -> None:
    step = make_step([], num_heads=8, num_kv_heads=2, block_size=16, head_dim=16)
    assert step.run(kernels.triton_paged_attention, None).shape == (0, 8, 16)


# ----- the registry and the default backend ---------------------------------------------------


def test_registered_as_triton(kernels: ModuleType) -> None:
    assert backends.get_attention_backend("triton") is kernels.triton_paged_attention


@pytest.fixture
def fresh_default() -> Iterator[None]:
    """The fallback reason is cached per process; start and end each test without it."""
    backends._triton_unavailable_reason.cache_clear()
    yield
    backends._triton_unavailable_reason.cache_clear()


def test_default_on_cpu_stays_batched(
    fresh_default: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rebar.kernels"):
        assert backends.default_attention_backend(torch.device("cpu")) == "batched"
    assert not caplog.records


def test_default_on_cuda_is_triton_when_it_imports(
    kernels: ModuleType, fresh_default: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backends.default_attention_backend(torch.device("cuda")) == "triton"


def test_default_on_cuda_without_triton_falls_back_once(
    fresh_default: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with caplog.at_level(logging.WARNING, logger="rebar.kernels"):
        assert backends.default_attention_backend(torch.device("cuda")) == "batched"
        assert backends.default_attention_backend(torch.device("cuda:0")) == "batched"
    assert len(caplog.records) == 1 and "Triton is not installed" in caplog.records[0].getMessage()


def test_default_without_cuda_falls_back_with_the_reason(
    fresh_default: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="rebar.kernels"):
        assert backends.default_attention_backend(torch.device("cuda")) == "batched"
    assert len(caplog.records) == 1 and "no CUDA" in caplog.records[0].getMessage()


def test_float32_queries_over_a_float16_cache(kernels: ModuleType) -> None:
    """engine.kv_cache_dtype = "float16" with a float32 model: the kernel reads the half-precision
    cache (this step's K/V rounded into it) as the reference backend does."""
    step = make_step(
        [(1, n) for n in (3, 40, 71)],
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        head_dim=32,
        seed=2,
    )

    def run(backend: Callable[..., torch.Tensor]) -> torch.Tensor:
        caches = [c.to(torch.float16) for c in (step.key_cache, step.value_cache)]
        q, k, v = (t.clone() for t in (step.q, step.k, step.v))
        return backend(q, k, v, *caches, step.meta, step.head_dim**-0.5, None)

    out = run(kernels.triton_paged_attention)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, run(paged_attention), atol=1e-5, rtol=0)
