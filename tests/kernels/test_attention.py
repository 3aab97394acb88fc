"""Paged attention backends against a dense reference, plus the backend registry.

The reference is written here independently of both backends: each sequence's keys and values
are kept contiguous, kv heads are repeated for GQA, and softmax(Q K^T * scale + mask) V is
computed in float64. The paged side sees the same data scattered over shuffled, non-contiguous
KV blocks whose unused slots hold garbage (NaN or huge values), so reading a slot outside a
sequence's context, or writing a new token to the wrong slot, changes the output.
"""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from rebar.errors import InvalidRequestError
from rebar.kernels import kv_quant
from rebar.kernels.attention import AttentionMetadata, pad_block_tables, paged_attention
from rebar.kernels.backends import (
    ATTENTION_BACKENDS,
    default_attention_backend,
    get_attention_backend,
)
from rebar.kernels.prompt_attention import causal_mask

BACKENDS = ["torch", "batched"]
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
GARBAGE = {"nan": float("nan"), "huge": 3e38}


@dataclass
class Step:
    """One attention call's inputs, plus each sequence's full K/V laid out contiguously."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    meta: AttentionMetadata
    dense_keys: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]
    dense_values: list[torch.Tensor]


def make_step(
    specs: list[tuple[int, int]],  # (query_len, context_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    garbage: float = float("nan"),
    seed: int = 0,
    extra_table_width: int = 2,
    head_dim: int = HEAD_DIM,
) -> Step:
    """Random data for one step; every cache slot outside the sequences' contexts holds `garbage`.

    Blocks are dealt from a shuffled pool that never hands out block 0 (the padding value of the
    block tables), so table padding and the tails of partly used blocks both point at garbage.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_needed = sum(-(-context_len // block_size) for _, context_len in specs)
    num_blocks = num_needed + 7
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, garbage, dtype=dtype)
    value_cache = torch.full(shape, garbage, dtype=dtype)

    tables, slots, dense_keys, dense_values, new_k, new_v = [], [], [], [], [], []
    for query_len, context_len in specs:
        table = [pool.pop() for _ in range(-(-context_len // block_size))]
        seq_slots = [
            table[p // block_size] * block_size + p % block_size for p in range(context_len)
        ]
        keys = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        num_cached = context_len - query_len
        cached = torch.tensor(seq_slots[:num_cached], dtype=torch.long)
        key_cache.view(-1, num_kv_heads, head_dim)[cached] = keys[:num_cached]
        value_cache.view(-1, num_kv_heads, head_dim)[cached] = values[:num_cached]
        tables.append(table)
        slots.extend(seq_slots[num_cached:])
        new_k.append(keys[num_cached:])
        new_v.append(values[num_cached:])
        dense_keys.append(keys)
        dense_values.append(values)

    block_tables = pad_block_tables(tables)
    # Runners may keep wider tables than this step needs; the extra columns are padding too.
    block_tables = torch.cat(
        [block_tables, torch.zeros(len(specs), extra_table_width, dtype=torch.long)], dim=1
    )
    num_tokens = sum(query_len for query_len, _ in specs)
    meta = AttentionMetadata(
        query_lens=tuple(query_len for query_len, _ in specs),
        context_lens=tuple(context_len for _, context_len in specs),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=block_tables,
    )
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    empty = torch.empty(0, num_kv_heads, head_dim, dtype=dtype)
    return Step(
        q,
        torch.cat([empty, *new_k]),
        torch.cat([empty, *new_v]),
        key_cache,
        value_cache,
        meta,
        dense_keys,
        dense_values,
    )


def dense_attention(step: Step, scale: float, sliding_window: int | None) -> torch.Tensor:
    """softmax(Q K^T * scale + mask) V per sequence in float64 on contiguous K/V."""
    outputs, start = [], 0
    num_heads = step.q.shape[1]
    for query_len, context_len, keys, values in zip(
        step.meta.query_lens, step.meta.context_lens, step.dense_keys, step.dense_values
    ):
        q = step.q[start : start + query_len].double()  # [t, h, d]
        start += query_len
        group = num_heads // keys.shape[1]
        keys = keys.double().repeat_interleave(group, dim=1)  # [s, h, d]
        values = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) * scale
        query_pos = torch.arange(context_len - query_len, context_len)[:, None]
        key_pos = torch.arange(context_len)[None, :]
        allowed = key_pos <= query_pos
        if sliding_window is not None:
            allowed &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outputs.append(torch.einsum("hts,shd->thd", scores.softmax(dim=-1), values))
    return torch.cat(outputs)


def mixed_specs(block_size: int) -> list[tuple[int, int]]:
    """Fresh prompts, chunks continuing a cached context and decode rows, in a scrambled order.

    Context lengths include exact multiples of the block size and lengths just past one.
    """
    bs = block_size
    return [
        (1, 3 * bs + 1),  # decode, one token into a new block
        (7, 7),  # fresh prompt
        (4, 3 * bs + 2),  # chunk after a cached prefix
        (1, 2 * bs),  # decode, context an exact multiple
        (2 * bs, 2 * bs),  # fresh prompt, exact multiple
        (bs, 3 * bs),  # chunk, exact multiple, starting at a block boundary
        (1, 1),  # decode of a one-token prompt
        (3, 9),  # short chunk
        (1, 4 * bs + 3),  # longest decode
    ]


def decode_specs(block_size: int) -> list[tuple[int, int]]:
    bs = block_size
    return [(1, c) for c in (3 * bs + 1, 2 * bs, 1, 4 * bs + 3, bs - 1, 5 * bs)]


def prefill_specs(block_size: int) -> list[tuple[int, int]]:
    bs = block_size
    return [(7, 7), (4, 3 * bs + 2), (2 * bs, 2 * bs), (bs, 3 * bs)]


BATCHES = {"mixed": mixed_specs, "decode_only": decode_specs, "prefill_only": prefill_specs}
HEADS = {"gqa_8q_2kv": (8, 2), "mha_4": (4, 4)}


def run_backend(name: str, step: Step, sliding_window: int | None) -> torch.Tensor:
    backend = get_attention_backend(name)
    return backend(
        step.q, step.k, step.v, step.key_cache, step.value_cache, step.meta, SCALE, sliding_window
    )


# ----- numerics against the dense reference ------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_float32_matches_dense_reference(
    backend: str, batch: str, heads: str, block_size: int, sliding_window: int | None
) -> None:
    num_heads, num_kv_heads = HEADS[heads]
    step = make_step(
        BATCHES[batch](block_size), num_heads, num_kv_heads, block_size, seed=block_size
    )
    out = run_backend(backend, step, sliding_window)
    expected = dense_attention(step, SCALE, sliding_window)
    assert out.shape == step.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_bfloat16_matches_dense_reference(
    backend: str, block_size: int, sliding_window: int | None
) -> None:
    step = make_step(mixed_specs(block_size), 8, 2, block_size, dtype=torch.bfloat16, seed=3)
    out = run_backend(backend, step, sliding_window)
    expected = dense_attention(step, SCALE, sliding_window)  # from the same bf16-rounded inputs
    assert out.dtype == torch.bfloat16
    # Outputs of size ~1 rounded to bf16 (ulp 2^-7 in [1, 2)); both backends measured ~1e-2 at most.
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)


def test_sliding_window_case_is_not_trivial() -> None:
    """The window used above really removes keys: dropping it changes the reference."""
    step = make_step(mixed_specs(5), 8, 2, 5)
    assert (dense_attention(step, SCALE, 6) - dense_attention(step, SCALE, None)).abs().max() > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("garbage", list(GARBAGE))
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_unused_cache_slots_never_reach_outputs(
    backend: str, garbage: str, sliding_window: int | None
) -> None:
    """Free blocks, table padding and the tails of partial blocks hold NaN or 3e38; outputs stay
    exact."""
    for batch in BATCHES.values():
        step = make_step(batch(5), 8, 2, 5, garbage=GARBAGE[garbage], seed=11)
        out = run_backend(backend, step, sliding_window)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(
            out.double(), dense_attention(step, SCALE, sliding_window), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_decode_batch_matches_dense_reference(backend: str) -> None:
    """A realistic decode step: 16 sequences, contexts ~300, 9 query / 3 kv heads, block size 16."""
    rng = random.Random(5)
    specs = [(1, rng.randint(280, 320)) for _ in range(16)]
    step = make_step(specs, 9, 3, 16, seed=5)
    out = run_backend(backend, step, None)
    torch.testing.assert_close(out.double(), dense_attention(step, SCALE, None), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window", [40, 100, 256, 700])
def test_long_windowed_prompts_match_dense_reference(backend: str, sliding_window: int) -> None:
    """Runs of queries longer than the batched backend's block of 64 (a fresh prompt, a chunk
    after a cached context, each block then reading only the keys its window sees, its mask a slice
    of the window's one mask), windows shorter and longer than that block, a ragged last block,
    beside a decode row."""
    specs = [(600, 600), (300, 900), (1, 400), (257, 257), (77, 141)]
    step = make_step(specs, 8, 2, 16, seed=9)
    out = run_backend(backend, step, sliding_window)
    assert torch.isfinite(out).all()
    expected = dense_attention(step, SCALE, sliding_window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_without_sequences_gives_an_empty_output(backend: str) -> None:
    step = make_step([], 8, 2, 5)
    assert run_backend(backend, step, None).shape == (0, 8, HEAD_DIM)


# ----- the cache writes ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_keys_and_values_are_written_to_their_slots_only(backend: str) -> None:
    step = make_step(mixed_specs(5), 8, 2, 5, garbage=7.0)
    keys_before, values_before = step.key_cache.clone(), step.value_cache.clone()
    run_backend(backend, step, None)

    slots = step.meta.slot_mapping
    flat_keys = step.key_cache.view(-1, 2, HEAD_DIM)
    flat_values = step.value_cache.view(-1, 2, HEAD_DIM)
    assert torch.equal(flat_keys[slots], step.k)
    assert torch.equal(flat_values[slots], step.v)

    expected_keys, expected_values = (
        keys_before.view(-1, 2, HEAD_DIM),
        values_before.view(-1, 2, HEAD_DIM),
    )
    expected_keys[slots], expected_values[slots] = step.k, step.v
    assert torch.equal(flat_keys, expected_keys), "a slot outside slot_mapping changed"
    assert torch.equal(flat_values, expected_values), "a slot outside slot_mapping changed"

    # And every sequence's whole context now sits where its block table says.
    for table, context_len, keys in zip(
        step.meta.block_tables, step.meta.context_lens, step.dense_keys
    ):
        positions = torch.arange(context_len)
        context_slots = table[positions // 5] * 5 + positions % 5
        assert torch.equal(flat_keys[context_slots], keys)


# ----- the Q8_0 cache --------------------------------------------------------------------------


def q8_0_step(specs: list[tuple[int, int]], garbage: float = float("nan"), seed: int = 0) -> Step:
    """A step (head_dim 32) whose cache holds Q8_0 rows, and whose dense reference reads every key
    and value, this step's new ones too, rounded through Q8_0 as a backend must. Garbage rows get
    a NaN or infinite scale, so reading one poisons the output."""
    step = make_step(specs, 8, 2, 5, garbage=garbage, seed=seed, head_dim=32)

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return kv_quant.dequantize(kv_quant.quantize(x), x.dtype)

    step.key_cache = kv_quant.quantize(step.key_cache)
    step.value_cache = kv_quant.quantize(step.value_cache)
    step.dense_keys = [rounded(keys) for keys in step.dense_keys]
    step.dense_values = [rounded(values) for values in step.dense_values]
    return step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("garbage", list(GARBAGE))
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_q8_0_cache_matches_dense_reference(
    backend: str, batch: str, garbage: str, sliding_window: int | None
) -> None:
    step = q8_0_step(BATCHES[batch](5), GARBAGE[garbage], seed=2)
    out = run_backend(backend, step, sliding_window)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    expected = dense_attention(step, SCALE, sliding_window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_q8_0_rounding_is_visible_in_the_reference() -> None:
    """The rounding the test above expects is real: the unrounded reference is further away."""
    step = make_step(mixed_specs(5), 8, 2, 5, seed=2, head_dim=32)
    exact = dense_attention(step, SCALE, None)
    rounded = dense_attention(q8_0_step(mixed_specs(5), seed=2), SCALE, None)
    assert (exact - rounded).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_q8_0_writes_are_the_quantized_rows_at_their_slots_only(backend: str) -> None:
    step = q8_0_step(mixed_specs(5), garbage=7.0)
    keys_before, values_before = step.key_cache.clone(), step.value_cache.clone()
    run_backend(backend, step, None)
    slots, width = step.meta.slot_mapping, kv_quant.row_bytes(32)
    for cache, before, new in (
        (step.key_cache, keys_before, step.k),
        (step.value_cache, values_before, step.v),
    ):
        expected = before.view(-1, 2, width).clone()
        expected[slots] = kv_quant.quantize(new)
        assert torch.equal(cache.view(-1, 2, width), expected)


# ----- the registry ----------------------------------------------------------------------------


def test_registry_names_resolve_to_callables() -> None:
    assert set(BACKENDS) <= set(ATTENTION_BACKENDS)
    assert get_attention_backend("torch") is paged_attention
    from rebar.kernels.attention_batched import batched_paged_attention

    assert get_attention_backend("batched") is batched_paged_attention


@pytest.mark.parametrize("name", ["flash", "", "Torch", None])
def test_unknown_backend_is_a_typed_error_listing_the_known_names(name: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        get_attention_backend(name)  # type: ignore[arg-type]
    assert caught.value.param == "attention_backend"
    for known in ATTENTION_BACKENDS:
        assert known in str(caught.value)


def test_default_backend_is_the_batched_one_on_cpu() -> None:
    assert default_attention_backend(torch.device("cpu")) == "batched"


def test_backend_modules_are_imported_lazily() -> None:
    code = (
        "import sys, rebar.kernels.backends as b\n"
        "assert 'rebar.kernels.attention_batched' not in sys.modules\n"
        "b.get_attention_backend('batched')\n"
        "assert 'rebar.kernels.attention_batched' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_model_resolves_its_backend_once_for_every_layer() -> None:
    from rebar.kernels.attention_batched import batched_paged_attention
    from rebar.model.config import ModelConfig
    from rebar.model.llama import LlamaModel

    config = ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=4, intermediate_size=32,
        max_position_embeddings=64, norm_eps=1e-5, num_kv_heads=2, head_dim=4,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaModel(config, attention_backend="batched")
        assert all(layer.attn.backend is batched_paged_attention for layer in model.layers)
        assert LlamaModel(config).layers[0].attn.backend is paged_attention
        with pytest.raises(InvalidRequestError):
            LlamaModel(config, attention_backend="nope")


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_prompts_in_key_tiles_match_dense_reference(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the first key tile a layer without a window merges a mask-free call over the whole
    tiles before a query's own with a causal one over its own tile (tiles of 128 here): a fresh
    prompt over five tiles, chunks starting inside a tile and at one's start, beside a decode row."""
    from rebar.kernels import prompt_attention

    monkeypatch.setattr(prompt_attention, "QUERY_BLOCK", 64)
    monkeypatch.setattr(prompt_attention, "KEY_TILE", 128)
    specs = [(600, 600), (300, 900), (256, 768), (1, 400), (100, 100)]
    step = make_step(specs, 8, 2, 16, seed=11)
    out = run_backend(backend, step, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_attention(step, SCALE, None), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 16), (9, 3, 64), (4, 1, 256)])
@pytest.mark.parametrize("window", [None, 96])
def test_a_query_gets_the_same_bits_however_its_prompt_was_cut_and_whatever_its_length(
    window: int | None, heads: int, kv_heads: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each query attends in a call shaped by its absolute position alone: the rows a fresh prompt
    of any length computes, and those of a chunk after any number of cached tokens ending
    anywhere, are the bits the whole prompt computes for the same positions (blocks of 64 queries
    in tiles of 256 keys here; a window of 96 in blocks of 16)."""
    from rebar.kernels import prompt_attention

    monkeypatch.setattr(prompt_attention, "QUERY_BLOCK", 64)
    monkeypatch.setattr(prompt_attention, "KEY_TILE", 256)
    monkeypatch.setattr(prompt_attention, "WINDOW_QUERY_BLOCK", 16)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(700, heads, head_dim, generator=generator)
    keys = torch.randn(700, kv_heads, head_dim, generator=generator)
    values = torch.randn(700, kv_heads, head_dim, generator=generator)
    scale = head_dim**-0.5

    def attend(first: int, end: int) -> torch.Tensor:
        start = prompt_attention.window_start(first, window)
        return prompt_attention.prompt_attention(
            q[first:end], keys[start:end], values[start:end], first, start, scale, window
        )

    whole = attend(0, 700)
    reference = dense_reference(q, keys, values, window, scale)
    torch.testing.assert_close(whole, reference, atol=1e-5, rtol=0)
    for length in (1, 2, 3, 5, 33, 63, 64, 100, 255, 256, 300, 511, 600):  # fresh prompts
        assert torch.equal(attend(0, length), whole[:length]), length
    for first, end in (
        (300, 700),
        (256, 700),
        (1, 700),
        (300, 301),
        (300, 302),
        (300, 333),
        (17, 530),
        (290, 295),
        (699, 700),
    ):
        assert torch.equal(attend(first, end), whole[first:end]), (first, end)


def dense_reference(q, keys, values, window, scale):
    """Causal (windowed) attention of every position over the keys before it, in float64."""
    positions = torch.arange(q.shape[0])
    allowed = causal_mask(positions, positions, window)
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).float()
