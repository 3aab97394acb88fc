"""The fused CPU decode step against the model's own forward (an independent, op-by-op Python path)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.kernels.cpu_quant_helpers import require_kernels
from tests.tiny_engine import tiny_config, tiny_model

from markers import need_smollm2
from rebar.kernels import kv_quant
from rebar.kernels.attention import AttentionMetadata, KVCache, pad_block_tables
from rebar.kernels.cpu_quant.build import load_extension
from rebar.model.fused_decode import FusedDecoder, unsupported_reason
from rebar.weights.handler import swap_in_quantized
from rebar.weights.int_formats import quantize_int4, quantize_int8
from rebar.weights.qlinear import DequantizedMatmul, KernelChoice

BLOCK_SIZE = 4
NUM_BLOCKS = 40
Q8_0 = kv_quant.STORAGE_DTYPE  # a KV cache of Q8_0 rows (head_dim a multiple of 32)
CACHE_DTYPES = [torch.float32, torch.float16, Q8_0]
# Linears stored int8 (per output channel) in the mixed model; the rest int4, group 32.
INT8_LINEARS = ("attn.v_proj", "mlp.down_proj")


@pytest.fixture(autouse=True)
def _kernels() -> None:
    require_kernels()


def quantized_model(mixed_bits: bool = True, **config_overrides) -> torch.nn.Module:
    config = tiny_config(**config_overrides)
    model = tiny_model(config, seed=3)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            int8 = mixed_bits and name.endswith(INT8_LINEARS)
            weights[f"{name}.weight"] = (
                quantize_int8(module.weight) if int8 else quantize_int4(module.weight, 32)
            )
    swap_in_quantized(model, weights, torch.float32)
    return model


def new_cache(
    model: torch.nn.Module, dtype: torch.dtype = torch.float32, num_blocks: int = NUM_BLOCKS
) -> KVCache:
    c = model.config
    cache = KVCache(c.num_layers, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, dtype)
    for t in cache.keys + cache.values:  # allocated uninitialised; zeros make "untouched" checkable
        t.zero_()
    return cache


def metadata(
    query_lens: list[int], context_lens: list[int], tables: list[list[int]]
) -> tuple[torch.Tensor, AttentionMetadata]:
    positions, slots = [], []
    for q, c, table in zip(query_lens, context_lens, tables):
        for p in range(c - q, c):
            positions.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
    meta = AttentionMetadata(
        tuple(query_lens), tuple(context_lens), torch.tensor(slots), pad_block_tables(tables)
    )
    return torch.tensor(positions), meta


# Each sequence's blocks, deliberately out of order and interleaved with the others'.
TABLES = [[7, 2, 30, 11, 5], [1, 25, 9], [33, 3, 18, 22, 0, 14]]


def decode_both(
    model: torch.nn.Module,
    prompt_lens: list[int],
    seed: int = 0,
    fused: bool = True,
    cache_dtype: torch.dtype = torch.float32,
    tables: list[list[int]] | None = None,
):
    """Prefill every sequence, then one decode step through the model and through the fused decoder
    (each on its own copy of the cache). Returns (model hidden, fused hidden, model cache, fused
    cache, slots); with `fused=False` only the model runs (fused hidden is None)."""
    gen = torch.Generator().manual_seed(seed)
    tables = tables or TABLES[: len(prompt_lens)]
    num_blocks = max(max(t) for t in tables) + 1 if tables is not TABLES else NUM_BLOCKS
    num_blocks = max(num_blocks, NUM_BLOCKS)
    cache = new_cache(model, cache_dtype, num_blocks)
    with torch.inference_mode():
        ids = torch.randint(0, model.config.vocab_size, (sum(prompt_lens),), generator=gen)
        positions, meta = metadata(prompt_lens, prompt_lens, tables)
        model(ids, positions, meta, cache)
        fused_cache = new_cache(model, cache_dtype, num_blocks)
        for i in range(model.config.num_layers):
            fused_cache.keys[i].copy_(cache.keys[i])
            fused_cache.values[i].copy_(cache.values[i])
        decoder = FusedDecoder.build(model, fused_cache).decoder if fused else None
        assert decoder is not None or not fused

        ids = torch.randint(0, model.config.vocab_size, (len(prompt_lens),), generator=gen)
        positions, meta = metadata([1] * len(prompt_lens), [n + 1 for n in prompt_lens], tables)
        expected = model(ids, positions, meta, cache)
        positions, meta = metadata([1] * len(prompt_lens), [n + 1 for n in prompt_lens], tables)
        got = None
        if decoder is not None:
            got = decoder(ids, positions, meta)
    return expected, got, cache, fused_cache, meta.slot_mapping


def cache_shape(cache_dtype: torch.dtype, num_heads: int = 4) -> dict:
    """Model shape overrides for a cache of `cache_dtype`: Q8_0 rows need head_dim 32."""
    return {"head_dim": 32, "hidden_size": 32 * num_heads} if cache_dtype == Q8_0 else {}


def path_tolerance(cache_dtype: torch.dtype) -> float:
    """How far the two paths may part. Both round the same float32 K/V (up to round-off) to the
    same stored values, except where that round-off straddles a rounding boundary: 2^-11 relative
    for float16; one code step (a 127th of the block's largest value) for Q8_0."""
    return {torch.float32: 1e-5, torch.float16: 1e-3}.get(cache_dtype, 1e-2)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def silence(model: torch.nn.Module, path: str) -> None:
    """Make `path` (a quantized linear of layer 0) output zeros, in both paths (they share the
    codes)."""
    packed = model.layers[0].get_submodule(path).kernels[0].kernel.packed
    packed.scales.zero_()
    if packed.offsets is not None:
        packed.offsets.zero_()


# Both paths round activations to int8 per block of 32 with the same kernels, but their norms and
# attention differ in float32 round-off; a difference that lands on a rounding boundary flips one
# activation code, and a tiny random model (two blocks per row) amplifies flips from layer to
# layer. So exactness is checked one half-layer at a time, where nothing compounds, and the whole
# stack by its accuracy against float math.


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("prompt_lens", [[5], [5, 11, 18], [3, 1, 21]])
@pytest.mark.parametrize("half", ["attention", "mlp"])
def test_each_half_layer_matches_the_model(
    half: str, prompt_lens: list[int], num_threads: int, cache_dtype: torch.dtype
) -> None:
    model = quantized_model(num_layers=1, **cache_shape(cache_dtype))
    silence(model, "mlp.down_proj" if half == "attention" else "attn.o_proj")
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        expected, got, cache, fused_cache, slots = decode_both(
            model, prompt_lens, cache_dtype=cache_dtype
        )
    finally:
        torch.set_num_threads(previous)
    tolerance = path_tolerance(cache_dtype)
    assert relative_error(got, expected) < tolerance
    # This step's K/V landed in the same slots with the same values, and nothing else changed.
    for mine, theirs in (
        (fused_cache.keys[0], cache.keys[0]),
        (fused_cache.values[0], cache.values[0]),
    ):
        mine, theirs = mine.view(-1, *mine.shape[2:]), theirs.view(-1, *theirs.shape[2:])
        assert mine.dtype == cache_dtype
        written = [kv_quant.from_storage(t[slots], torch.float32) for t in (mine, theirs)]
        assert relative_error(*written) < tolerance
        untouched = torch.ones(mine.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(mine[untouched], theirs[untouched])


@pytest.mark.parametrize("half", ["attention", "mlp"])
def test_half_layers_with_biases_and_a_sliding_window(half: str) -> None:
    model = quantized_model(
        num_layers=1, qkv_bias=True, o_bias=True, mlp_bias=True, sliding_window=6
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
    silence(model, "mlp.down_proj" if half == "attention" else "attn.o_proj")
    expected, got, *_ = decode_both(model, [4, 9, 21])
    assert relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 1), (8, 2)])
def test_attention_for_other_head_groupings(
    num_heads: int, num_kv_heads: int, cache_dtype: torch.dtype
) -> None:
    """Query heads per KV head from 1 to 6 (the attention takes up to four heads of a group at once;
    six needs two passes), contexts longer and shorter than its eight-key blocks."""
    shape = {"hidden_size": 16 * num_heads, **cache_shape(cache_dtype, num_heads)}
    model = quantized_model(num_layers=1, num_heads=num_heads, num_kv_heads=num_kv_heads, **shape)
    silence(model, "mlp.down_proj")
    expected, got, *_ = decode_both(model, [2, 9, 21], cache_dtype=cache_dtype)
    assert relative_error(got, expected) < path_tolerance(cache_dtype)


def float_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The same model with every quantized linear computed in float from its dequantized weights
    (no activation rounding)."""
    import copy
    import math

    from rebar.weights.qlinear import DequantizedMatmul, KernelChoice, QuantLinear

    reference = copy.deepcopy(model)
    for module in reference.modules():
        if isinstance(module, QuantLinear):
            module.kernels = (KernelChoice(math.inf, DequantizedMatmul(module.weight_q)),)
    return reference


@pytest.mark.parametrize("mixed_bits", [True, False])
def test_whole_stack_is_as_accurate_as_the_model(mixed_bits: bool) -> None:
    for seed in range(3):
        model = quantized_model(mixed_bits=mixed_bits, num_layers=3)
        expected, got, *_ = decode_both(model, [5, 11, 18], seed=seed)
        truth, *_ = decode_both(float_reference(model), [5, 11, 18], seed=seed, fused=False)
        model_error, fused_error = relative_error(expected, truth), relative_error(got, truth)
        assert model_error < 0.2 and fused_error < 1.5 * model_error + 0.01, (
            seed,
            model_error,
            fused_error,
        )


def shuffled_tables(prompt_lens: list[int], seed: int = 0) -> list[list[int]]:
    """Block tables for contexts one token longer than the prompts, from one shuffled pool."""
    needed = [-(-(n + 1) // BLOCK_SIZE) for n in prompt_lens]
    pool = torch.randperm(sum(needed), generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(pool[used : used + count])
        used += count
    return tables


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(
    ("prompt_lens", "window"), [([300, 5, 600], None), ([256, 257, 1100], None), ([700, 40], 300)]
)
def test_long_contexts_split_over_threads_match_the_model(prompt_lens, window, cache_dtype) -> None:
    """Contexts over 256 positions are attended in pieces that are merged afterwards (exactly 256
    and 257 straddle the split; a window longer than a piece splits the window, not the context)."""
    model = quantized_model(num_layers=1, sliding_window=window, **cache_shape(cache_dtype))
    silence(model, "mlp.down_proj")
    expected, got, *_ = decode_both(
        model, prompt_lens, cache_dtype=cache_dtype, tables=shuffled_tables(prompt_lens)
    )
    assert relative_error(got, expected) < path_tolerance(cache_dtype)


def test_float16_cache_costs_little_accuracy() -> None:
    """The whole stack over a float16 cache is about as close to float math as over a float32 one
    (the int8 activation rounding, amplified by the tiny model, dominates both)."""
    for seed in range(3):
        model = quantized_model(num_layers=3)
        wide, *_ = decode_both(model, [5, 11, 18], seed=seed, fused=False)
        _, narrow, *_ = decode_both(model, [5, 11, 18], seed=seed, cache_dtype=torch.float16)
        truth, *_ = decode_both(float_reference(model), [5, 11, 18], seed=seed, fused=False)
        wide_error, narrow_error = relative_error(wide, truth), relative_error(narrow, truth)
        assert narrow_error < 1.5 * wide_error + 0.01, (seed, wide_error, narrow_error)


def test_q8_0_cache_costs_little_accuracy() -> None:
    """The whole stack over a Q8_0 cache stays about as close to float math as over a float16 one."""
    for seed in range(3):
        model = quantized_model(num_layers=3, **cache_shape(Q8_0))
        _, half, *_ = decode_both(model, [5, 11, 18], seed=seed, cache_dtype=torch.float16)
        _, eight_bit, *_ = decode_both(model, [5, 11, 18], seed=seed, cache_dtype=Q8_0)
        truth, *_ = decode_both(float_reference(model), [5, 11, 18], seed=seed, fused=False)
        half_error, eight_bit_error = relative_error(half, truth), relative_error(eight_bit, truth)
        assert eight_bit_error < 1.5 * half_error + 0.02, (seed, half_error, eight_bit_error)


def test_unsupported_models_say_why() -> None:
    float_model = tiny_model(tiny_config())
    assert "not quantized" in unsupported_reason(float_model, new_cache(float_model))
    model = quantized_model()
    c = model.config
    bf16_cache = KVCache(c.num_layers, 4, BLOCK_SIZE, c.num_kv_heads, c.head_dim, torch.bfloat16)
    assert "bfloat16" in unsupported_reason(model, bf16_cache)
    odd_heads = quantized_model(num_heads=8, head_dim=12, hidden_size=64)
    assert "multiple of 8" in unsupported_reason(odd_heads, new_cache(odd_heads))
    assert FusedDecoder.build(float_model, new_cache(float_model)).decoder is None
    with pytest.raises(ValueError, match="multiple of 32 \\(the Q8_0 block\\); this model's is 16"):
        KVCache(c.num_layers, 4, BLOCK_SIZE, c.num_kv_heads, c.head_dim, Q8_0)


def test_row_limit_is_what_the_model_paths_kernels_serve() -> None:
    """rebar's kernels serve any number of rows, int4 and int8 alike; a plan that caps a linear's
    rows (a test pinning a kernel) caps the fused step's too, so decode rows take the path the
    model's own forward would take on the same kernels."""
    all_int4 = quantized_model(mixed_bits=False)
    mixed = quantized_model(mixed_bits=True)
    assert FusedDecoder.build(all_int4, new_cache(all_int4)).decoder.max_rows == math.inf
    assert FusedDecoder.build(mixed, new_cache(mixed)).decoder.max_rows == math.inf
    linear = mixed.layers[1].mlp.up_proj
    linear.kernels = (
        KernelChoice(24, linear.kernels[0].kernel),
        KernelChoice(math.inf, DequantizedMatmul(linear.weight_q)),
    )
    assert FusedDecoder.build(mixed, new_cache(mixed)).decoder.max_rows == 24


class TestBadStepsFailCleanly:
    """Every cache address is checked before anything is computed: errors, and the cache is
    untouched."""

    @pytest.fixture
    def setup(self):
        model = quantized_model()
        cache = new_cache(model)
        decoder = FusedDecoder.build(model, cache).decoder
        return model, cache, decoder

    def step(self, decoder, model, slots, tables, context_lens, rows=1):
        hidden, head_dim = model.config.hidden_size, model.config.head_dim
        cos, sin = torch.ones(rows, head_dim), torch.zeros(rows, head_dim)
        decoder._decoder.step(
            torch.zeros(rows, hidden),
            cos,
            sin,
            cos,
            sin,
            torch.tensor(slots),
            torch.tensor(tables),
            context_lens,
        )

    @pytest.mark.parametrize(
        ("slots", "tables", "context_lens", "message"),
        [
            ([NUM_BLOCKS * BLOCK_SIZE], [[0]], [1], "slot"),
            ([-1], [[0]], [1], "slot"),
            ([0], [[NUM_BLOCKS]], [1], "block"),
            ([0], [[0, -3]], [5], "block"),
            ([0], [[0]], [0], "context length"),
            ([0], [[0]], [BLOCK_SIZE + 1], "context length"),
        ],
    )
    def test_out_of_range(self, setup, slots, tables, context_lens, message) -> None:
        model, cache, decoder = setup
        with pytest.raises(ValueError, match=message):
            self.step(decoder, model, slots, tables, context_lens)
        assert all(t.count_nonzero() == 0 for t in cache.keys + cache.values)

    def test_wrong_shapes(self, setup) -> None:
        model, _, decoder = setup
        with pytest.raises(ValueError, match="x must be"):
            table = torch.ones(1, 16)
            decoder._decoder.step(
                torch.zeros(1, 3),
                table,
                table,
                table,
                table,
                torch.tensor([0]),
                torch.tensor([[0]]),
                [1],
            )
        with pytest.raises(ValueError, match="one context length per row"):
            self.step(decoder, model, [0], [[0]], [1, 1])

    def test_caches_of_mixed_dtypes_are_refused(self, setup) -> None:
        model, _cache, _ = setup
        c = model.config
        half = KVCache(
            c.num_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim, torch.float16
        )
        mixed = KVCache(
            c.num_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim, torch.float32
        )
        mixed.keys[1] = half.keys[1]
        mixed.values[1] = half.values[1]
        with pytest.raises(ValueError, match="same blocks and dtype"):
            FusedDecoder(model, mixed, load_extension().module)
        mixed.values[0] = half.values[0]
        with pytest.raises(ValueError, match="differ in shape or dtype"):
            FusedDecoder(model, mixed, load_extension().module)


def test_concurrent_steps_from_two_threads_agree_with_sequential_ones() -> None:
    """The step releases the GIL; a second caller while the worker pool is busy computes on its own
    thread and must get exactly what it would alone."""
    import threading

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = quantized_model(num_layers=2)
        caches = [new_cache(model), new_cache(model)]
        decoders = [FusedDecoder.build(model, cache).decoder for cache in caches]
        positions, meta = metadata([1, 1, 1], [6, 12, 22], TABLES)
        ids = torch.tensor([5, 17, 33])
        with torch.inference_mode():
            alone = decoders[0](ids, positions, meta)
            results: list[torch.Tensor | None] = [None, None]

            def run(index: int) -> None:
                with torch.inference_mode():
                    for _ in range(20):
                        results[index] = decoders[index](ids, positions, meta)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(result, alone) for result in results)


def test_smollm2_fused_steps_are_as_accurate_as_the_model_on_the_real_checkpoint() -> None:
    """SmolLM2's GGUF kept quantized: the engine uses the fused step, and teacher-forced decoding
    through it is as close to the float model (the same weights, dequantized) as the quantized
    model's own forward is."""
    need_smollm2()
    from rebar import LLM
    from rebar.engine.scheduler import ScheduledRequest

    quantized, reference = (
        LLM(model="smollm2", device="cpu"),
        LLM(model="smollm2", device="cpu", dequantize=True),
    )
    runner, float_runner = quantized.engine.runner, reference.engine.runner
    assert runner.fused_decoder is not None and float_runner.fused_decoder is None
    prompt = quantized.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    text = quantized.tokenizer.encode(
        " Rome. The capital of Spain is Madrid, and the capital of Germany is Berlin. Each city has a long"
        " history, and many people visit them every year to see the museums and old streets."
    )
    paths = {  # name -> (runner, blocks, forward)
        "model": (
            runner,
            (1, 2, 3, 4, 5, 6),
            lambda ids, pos, meta: runner.model(ids, pos, meta, runner.kv_cache),
        ),
        "fused": (runner, (11, 12, 13, 14, 15, 16), runner.fused_decoder),
        "float": (
            float_runner,
            (1, 2, 3, 4, 5, 6),
            lambda ids, pos, meta: float_runner.model(ids, pos, meta, float_runner.kv_cache),
        ),
    }
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in paths}
    with torch.inference_mode():
        for name, (owner, blocks, _) in paths.items():
            ids, positions, meta = owner._metadata(
                [ScheduledRequest(name, tuple(prompt), 0, blocks, True)]
            )
            owner.model(ids, positions, meta, owner.kv_cache)
        for step, token in enumerate(text):
            for name, (owner, blocks, forward) in paths.items():
                ids, positions, meta = owner._metadata(
                    [ScheduledRequest(name, (token,), len(prompt) + step, blocks, True)]
                )
                logits[name].append(owner.model.compute_logits(forward(ids, positions, meta))[0])

    def against_float(name: str) -> tuple[float, float]:
        pairs = list(zip(logits[name], logits["float"]))
        top1 = sum(int(a.argmax() == b.argmax()) for a, b in pairs) / len(pairs)
        return top1, sum(relative_error(a, b) for a, b in pairs) / len(pairs)

    (model_top1, model_error), (fused_top1, fused_error) = (
        against_float("model"),
        against_float("fused"),
    )
    assert fused_error < 1.2 * model_error, (fused_error, model_error)
    assert fused_top1 >= model_top1 - 0.1 and fused_top1 >= 0.85, (fused_top1, model_top1)


def test_runner_sends_the_decode_rows_of_a_mixed_step_through_the_fused_step() -> None:
    """A step holding a decode row and prompt chunks: the decode row goes through the fused step and
    the prompts through the model, and each gets the logits it gets alone, in the step's order
    (equal up to the float lm_head's batch-size round-off)."""
    from rebar.engine.runner import ModelRunner
    from rebar.engine.scheduler import ScheduledRequest

    model = quantized_model(num_layers=2)

    def runner_with_a_prefilled_sequence() -> tuple[ModelRunner, list]:
        runner = ModelRunner(model, model.config, new_cache(model), torch.device("cpu"))
        runner.execute([ScheduledRequest("a", tuple(range(3, 12)), 0, (7, 2, 30), True)])
        fused, calls = runner.fused_decoder, []
        assert fused is not None

        class Spy:
            max_rows = 2

            def __call__(self, input_ids, positions, meta):
                calls.append(input_ids.tolist())
                return fused(input_ids, positions, meta)

        runner.fused_decoder = Spy()
        return runner, calls

    decode_a = ScheduledRequest("a", (40,), 9, (7, 2, 30), True)
    prompt_b = ScheduledRequest("b", tuple(range(50, 56)), 0, (1, 25), True)
    chunk_c = ScheduledRequest("c", tuple(range(60, 65)), 0, (33, 3), False)  # not sampled
    runner, calls = runner_with_a_prefilled_sequence()
    mixed = runner.execute([prompt_b, decode_a, chunk_c])
    assert calls == [[40]]  # only the decode row, once
    alone, _ = runner_with_a_prefilled_sequence()
    decode_only, prompt_only = alone.execute([decode_a]), alone.execute([prompt_b])
    assert mixed.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(mixed[0], prompt_only[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1], decode_only[0], rtol=1e-5, atol=1e-5)
    assert runner.execute([chunk_c]).shape == (0, model.config.vocab_size)  # nothing to sample
    # More decode rows than the fused step takes: the whole step goes through the model.
    calls.clear()
    three = [
        ScheduledRequest(name, (40,), 0, (block,), True)
        for name, block in (("x", 20), ("y", 21), ("z", 22))
    ]
    assert runner.execute(three).shape == (3, model.config.vocab_size) and calls == []
    assert runner.execute(three[:2]).shape == (2, model.config.vocab_size) and calls == [[40, 40]]


@pytest.mark.parametrize(
    ("env", "warned"),
    [({}, True), ({"GOMP_SPINCOUNT": "30000"}, False), ({"OMP_WAIT_POLICY": "PASSIVE"}, False)],
)
def test_the_runner_warns_when_openmp_spin_is_left_at_its_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, env, warned
) -> None:
    """A program embedding rebar with libgomp's default busy-wait hears how to fix it once a fused
    decode step is built; a setting of either variable (the rebar command's, or the user's) keeps
    it quiet."""
    from rebar.engine.runner import ModelRunner

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = quantized_model(num_layers=1)
    with caplog.at_level("WARNING", logger="rebar.engine"):
        runner = ModelRunner(model, model.config, new_cache(model), torch.device("cpu"))
    assert runner.fused_decoder is not None
    warnings = [r.getMessage() for r in caplog.records if "GOMP_SPINCOUNT" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)
    if warned:
        assert "rebar.shorten_openmp_spin()" in warnings[0]


def test_a_fused_step_is_one_range_in_a_profile() -> None:
    """Profiles (rebar profile, /admin/profile) show a fused decode step as one named range, where
    the model's own forward shows one per layer."""
    from torch.profiler import profile

    from rebar.model.fused_decode import PROFILE_RANGE

    model = quantized_model()
    with profile() as prof:
        decode_both(model, [5, 9])
    assert PROFILE_RANGE in {event.name for event in prof.events()}


# The Llama family's variations the fused step computes (model/config.py): Qwen 3's q/k norms; Gemma
# 3's sandwich norms, GeGLU, scaled embedding, own attention scale, and local sliding-window layers
# with their own RoPE base beside global ones.
FAMILIES = {
    "qwen3": dict(qk_norm=True),
    "gemma3-local": dict(
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        embedding_scale=8.0,
        attention_scale=0.2,
        sliding_window=6,
        sliding_layers=(True,),
        rope_local_theta=10000.0,
        rope_theta=1e6,
    ),
    "gemma3-global": dict(
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        embedding_scale=8.0,
        attention_scale=0.2,
        sliding_window=6,
        sliding_layers=(False,),
        rope_local_theta=10000.0,
        rope_theta=1e6,
    ),
}


@pytest.mark.parametrize("half", ["attention", "mlp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_half_layers_match_the_model(family: str, half: str) -> None:
    model = quantized_model(num_layers=1, **FAMILIES[family])
    assert FusedDecoder.build(model, new_cache(model)).decoder is not None
    silence(model, "mlp.down_proj" if half == "attention" else "attn.o_proj")
    expected, got, *_ = decode_both(model, [5, 11, 18], cache_dtype=torch.float16)
    assert relative_error(got, expected) < 1e-3


def test_gemma3_stack_of_local_and_global_layers_is_as_accurate_as_the_model() -> None:
    overrides = {**FAMILIES["gemma3-local"], "sliding_layers": (True, False, True)}
    for seed in range(3):
        model = quantized_model(num_layers=3, **overrides)
        expected, got, *_ = decode_both(model, [5, 11, 18], seed=seed)
        truth, *_ = decode_both(float_reference(model), [5, 11, 18], seed=seed, fused=False)
        model_error, fused_error = relative_error(expected, truth), relative_error(got, truth)
        assert model_error < 0.2 and fused_error < 1.5 * model_error + 0.01, (
            seed,
            model_error,
            fused_error,
        )
