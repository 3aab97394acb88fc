"""EngineCore on a tiny random model: batching equivalence, prefix caching, preemption, aborts,
errors."""

from __future__ import annotations

import functools
import random
import time

import pytest
import torch

from rebar.engine.engine_config import kv_bytes_per_token
from rebar.engine.outputs import ENGINE_FAULT
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import InvalidRequestError
from rebar.kernels.best_logits import BestTokens
from rebar.llm import engine_config
from tiny_engine import VOCAB, make_core, run_to_completion, tiny_config, tokens_of

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def alone(tmp_path, prompt: list[int], params: SamplingParams, **engine: object) -> list[int]:
    core = make_core(tmp_path, **engine)
    core.add_request("solo", prompt, params)
    return tokens_of(run_to_completion(core)[("solo", 0)])


def test_batched_greedy_equals_one_at_a_time(tmp_path) -> None:
    batch = prompts(8)
    core = make_core(
        tmp_path, max_num_batched_tokens=24
    )  # forces chunked prefill alongside decodes
    for i, prompt in enumerate(batch):
        core.add_request(str(i), prompt, GREEDY)
    together = run_to_completion(core)
    for i, prompt in enumerate(batch):
        assert tokens_of(together[(str(i), 0)]) == alone(tmp_path, prompt, GREEDY)


def test_seeded_sampling_does_not_depend_on_the_batch(tmp_path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    target = prompts(1, seed=5)[0]
    core = make_core(tmp_path)
    core.add_request("target", target, params)
    for i, prompt in enumerate(prompts(6, seed=9)):
        core.add_request(
            f"noise{i}", prompt, SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)
        )
    busy = tokens_of(run_to_completion(core)[("target", 0)])
    assert busy == alone(tmp_path, target, params)


def test_identical_prompt_hits_the_prefix_cache(tmp_path) -> None:
    core = make_core(tmp_path)
    prompt = prompts(1, seed=3)[0] + list(range(2, 30))
    core.add_request("first", prompt, GREEDY)
    first = run_to_completion(core)[("first", 0)]
    hits_before = core.stats().num_prefix_hits
    core.add_request("second", prompt, GREEDY)
    second = run_to_completion(core)[("second", 0)]
    full_blocks = (len(prompt) - 1) // 4
    assert second[-1].num_cached_tokens == full_blocks * 4
    assert core.stats().num_prefix_hits - hits_before == full_blocks
    assert first[-1].num_cached_tokens == 0
    assert tokens_of(second) == tokens_of(first)


def test_prefix_cache_hits_need_the_same_cache_salt(tmp_path) -> None:
    core = make_core(tmp_path)
    prompt = list(range(2, 30))
    runs = {}
    for request_id, salt in (
        ("a1", "tenant-a"),
        ("b", "tenant-b"),
        ("none", None),
        ("a2", "tenant-a"),
        ("none2", None),
    ):
        core.add_request(request_id, prompt, GREEDY, cache_salt=salt)
        runs[request_id] = run_to_completion(core)[(request_id, 0)]
    cached = {request_id: outputs[-1].num_cached_tokens for request_id, outputs in runs.items()}
    assert cached == {"a1": 0, "b": 0, "none": 0, "a2": 24, "none2": 24}
    assert (
        len({tuple(tokens_of(outputs)) for outputs in runs.values()}) == 1
    )  # a hit changes no token
    assert_all_blocks_idle(core)


def test_cache_salt_must_be_a_string(tmp_path) -> None:
    with pytest.raises(InvalidRequestError) as info:
        make_core(tmp_path).add_request("x", [3, 4], GREEDY, cache_salt=7)
    assert info.value.param == "cache_salt"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "q8_0"])
def test_preemption_under_a_tiny_pool_still_completes_every_request_correctly(
    tmp_path, kv_cache_dtype
) -> None:
    """Preempted requests are recomputed to the same tokens, and every block comes back; with the
    8-bit cache too (whose rows need head_dim 32)."""
    batch = prompts(10, seed=7)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    shape = {"kv_cache_dtype": kv_cache_dtype}
    if kv_cache_dtype == "q8_0":
        shape["config"] = tiny_config(head_dim=32)
    big = make_core(tmp_path, num_blocks=256, **shape)
    small = make_core(
        tmp_path, num_blocks=40, enable_prefix_caching=False, **shape
    )  # 160 slots for ~10 x 50 tokens
    for core in (big, small):
        for i, prompt in enumerate(batch):
            core.add_request(str(i), prompt, params)
    expected, got = run_to_completion(big), run_to_completion(small)
    assert small.stats().num_preemptions > 0
    for i in range(len(batch)):
        assert tokens_of(got[(str(i), 0)]) == tokens_of(expected[(str(i), 0)])
        assert got[(str(i), 0)][-1].finish_reason == "length"
    assert small.stats().num_free_blocks == 40


def test_32_concurrent_requests_with_random_aborts_leave_no_blocks(tmp_path) -> None:
    rng = random.Random(0)
    core = make_core(tmp_path, num_blocks=48, max_num_seqs=16)
    live = set()
    for i, prompt in enumerate(prompts(32, seed=11)):
        core.add_request(
            str(i), prompt, SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.7, seed=i)
        )
        live.add(str(i))
    finished = {}
    while core.has_unfinished_requests():
        if rng.random() < 0.3 and live:
            victim = rng.choice(sorted(live))
            for output in core.abort_request(victim):
                finished[victim] = output.finish_reason
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output.finish_reason
        live -= set(finished)
        core.check_integrity()
    assert set(finished) == {str(i) for i in range(32)}
    assert "abort" in finished.values() and "length" in finished.values()
    assert core.stats().num_free_blocks == 48


def test_abort_frees_blocks_immediately(tmp_path) -> None:
    core = make_core(tmp_path)
    core.add_request("a", prompts(1)[0] + [5] * 20, SamplingParams(max_tokens=50, ignore_eos=True))
    core.step()
    assert core.stats().num_free_blocks < core.stats().num_blocks
    (output,) = core.abort_request("a")
    assert output.finished and output.finish_reason == "abort"
    assert core.stats().num_free_blocks == core.stats().num_blocks
    assert core.abort_request("a") == []  # unknown now: ignored


def test_n_choices_differ_and_replay_with_a_seed(tmp_path) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=42, ignore_eos=True)
    runs = []
    for _ in range(2):
        core = make_core(tmp_path)
        core.add_request("r", [3, 4, 5, 6, 7, 8], params)
        out = run_to_completion(core)
        runs.append([tokens_of(out[("r", i)]) for i in range(3)])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3


def test_deadline_finishes_with_timeout(tmp_path) -> None:
    core = make_core(tmp_path)
    core.add_request(
        "slow",
        [3, 4, 5],
        SamplingParams(max_tokens=100, ignore_eos=True),
        deadline=time.monotonic() - 1,
    )
    (output,) = core.step()
    assert output.finished and output.finish_reason == "timeout"
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_a_failing_request_fails_alone(tmp_path) -> None:
    core = make_core(tmp_path)
    core.add_request("bad", [3, 4, 5], GREEDY)
    core.add_request("good", [6, 7, 8], GREEDY)
    bad = core.scheduler.requests["bad"]

    def explode(token_id: int) -> str:
        raise RuntimeError("detokenizer broke")

    bad.state.detokenizer.add = explode
    out = run_to_completion(core)
    assert (
        out[("bad", 0)][-1].finish_reason == "error" and out[("bad", 0)][-1].error == ENGINE_FAULT
    )
    assert out[("good", 0)][-1].finish_reason == "length" and len(tokens_of(out[("good", 0)])) == 12


def test_a_failing_model_step_fails_its_batch_and_the_engine_recovers(
    tmp_path, monkeypatch
) -> None:
    core = make_core(tmp_path)
    core.add_request("a", [3, 4, 5, 6, 7], GREEDY)
    with monkeypatch.context() as patch:
        patch_model_steps(
            patch, core.runner, lambda real, items: (_ for _ in ()).throw(RuntimeError("lost"))
        )
        (output,) = core.step()
    assert (
        output.finish_reason == "error" and output.error == ENGINE_FAULT
    )  # no exception text for clients
    core.add_request("b", [3, 4, 5, 6, 7], GREEDY)
    out = run_to_completion(core)
    assert (
        out[("b", 0)][-1].num_cached_tokens == 0
    )  # the failed step's blocks were not left in the prefix cache
    assert out[("b", 0)][-1].finish_reason == "length"


def patch_model_steps(monkeypatch, runner, replace) -> None:
    """Send every model step, for logits or for greedy tokens alone, through
    `replace(real, items)`, `real` being the runner's own method for that step."""
    for name in ("execute", "execute_greedy"):
        monkeypatch.setattr(runner, name, functools.partial(replace, getattr(runner, name)))


def assert_all_blocks_idle(core) -> None:
    core.check_integrity()
    assert not core.has_unfinished_requests()
    assert core.stats().num_free_blocks == core.stats().num_blocks


def rows_of(items) -> list[str]:
    """Request ids of the logits rows `runner.execute(items)` returns, in order."""
    return [item.request_id for item in items if item.sample]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"top_k": 5},
        {"top_p": 0.5},
        {"min_p": 0.1},
        {"top_p": 1e-50},
        {"repetition_penalty": 1.5, "presence_penalty": 1.0, "frequency_penalty": 0.5},
    ],
)
def test_a_vanishing_temperature_is_greedy_and_harms_no_one(tmp_path, extra) -> None:
    """1e-50 underflows float32: it must mean greedy, not NaN probabilities and an id past the
    vocabulary."""
    tiny = SamplingParams(max_tokens=12, temperature=1e-50, ignore_eos=True, **extra)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **extra)
    core = make_core(tmp_path)
    core.add_request("tiny", [3, 4, 5], tiny)
    core.add_request("other", [6, 7, 8], GREEDY)
    out = run_to_completion(core)
    assert out[("tiny", 0)][-1].finish_reason == "length"
    assert tokens_of(out[("tiny", 0)]) == alone(tmp_path, [3, 4, 5], greedy)
    assert tokens_of(out[("other", 0)]) == alone(tmp_path, [6, 7, 8], GREEDY)
    assert_all_blocks_idle(core)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_a_row_of_broken_model_logits_fails_that_request_alone(
    tmp_path, monkeypatch, poison
) -> None:
    core = make_core(tmp_path)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    core.add_request("good", [6, 7, 8], GREEDY)
    core.add_request("bad", [3, 4, 5, 6, 7, 8, 9], GREEDY)
    core.add_request("sampled", [9, 8, 7], sampled)
    real = core.runner.execute

    def poisoned(items):
        logits = real(items)
        for row, request_id in enumerate(rows_of(items)):
            if request_id == "bad" and core.scheduler.requests["bad"].num_output_tokens == 2:
                logits[row] = poison
        return logits

    monkeypatch.setattr(core.runner, "execute", poisoned)
    out = run_to_completion(core)
    bad = out[("bad", 0)]
    assert bad[-1].finish_reason == "error" and bad[-1].error == ENGINE_FAULT
    assert (
        tokens_of(bad) == alone(tmp_path, [3, 4, 5, 6, 7, 8, 9], GREEDY)[:2]
    )  # no token from the broken row
    assert tokens_of(out[("good", 0)]) == alone(tmp_path, [6, 7, 8], GREEDY)
    assert tokens_of(out[("sampled", 0)]) == alone(tmp_path, [9, 8, 7], sampled)
    assert_all_blocks_idle(core)
    core.add_request("again", [3, 4, 5, 6, 7, 8, 9], GREEDY)
    assert (
        run_to_completion(core)[("again", 0)][-1].num_cached_tokens == 0
    )  # its KV was not left cached


def test_a_greedy_row_the_head_finds_no_token_for_fails_that_request_alone(
    tmp_path, monkeypatch
) -> None:
    """Steps whose rows are all plain greedy get best tokens, not logits: a row whose best is not
    valid (NaN or no finite value in its logits) fails its request alone there too."""
    core = make_core(tmp_path)
    core.add_request("good", [6, 7, 8], GREEDY)
    core.add_request("bad", [3, 4, 5, 6, 7, 8, 9], GREEDY)
    real = core.runner.execute_greedy
    broken = []

    def poisoned(items):
        best = BestTokens(*(t.clone() for t in real(items)))
        for row, request_id in enumerate(rows_of(items)):
            if request_id == "bad" and core.scheduler.requests["bad"].num_output_tokens == 2:
                best.valid[row] = False
                broken.append(row)
        return best

    monkeypatch.setattr(core.runner, "execute_greedy", poisoned)
    out = run_to_completion(core)
    assert broken  # the greedy path ran
    bad = out[("bad", 0)]
    assert bad[-1].finish_reason == "error" and bad[-1].error == ENGINE_FAULT
    assert tokens_of(bad) == alone(tmp_path, [3, 4, 5, 6, 7, 8, 9], GREEDY)[:2]
    assert tokens_of(out[("good", 0)]) == alone(tmp_path, [6, 7, 8], GREEDY)
    assert_all_blocks_idle(core)


@pytest.mark.parametrize(
    ("extra", "best_only"),
    [
        ({}, True),
        ({"logprobs": 0}, False),
        ({"logit_bias": {5: 2.0}}, False),
        ({"repetition_penalty": 1.2}, False),
        ({"temperature": 0.7, "seed": 1}, False),
    ],
)
def test_steps_compute_logits_unless_every_row_needs_only_its_best_token(
    tmp_path, monkeypatch, extra, best_only
) -> None:
    """The head skips the logits (execute_greedy) only in steps where every row is plain greedy
    with nothing reported from its logits; one row that needs them (log-probabilities, a bias, a
    penalty, a draw) gives the whole step logits, and the greedy rows' tokens do not change."""
    core = make_core(tmp_path)
    calls = {"execute": 0, "execute_greedy": 0}

    def count(name, real, items):
        calls[name] += 1
        return real(items)

    for name in calls:
        monkeypatch.setattr(
            core.runner, name, functools.partial(count, name, getattr(core.runner, name))
        )
    core.add_request("greedy", [3, 4, 5], GREEDY)
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}
    core.add_request("other", [6, 7, 8], SamplingParams(**params))
    out = run_to_completion(core)
    assert (calls["execute"] == 0) == best_only and (calls["execute_greedy"] > 0) == best_only
    assert tokens_of(out[("greedy", 0)]) == alone(tmp_path, [3, 4, 5], GREEDY)


def test_a_model_step_that_fails_because_of_one_request_fails_only_that_request(
    tmp_path, monkeypatch, caplog
) -> None:
    core = make_core(
        tmp_path, max_num_batched_tokens=24
    )  # chunked prefills share steps with decodes
    batch = prompts(5, seed=21)
    for i, prompt in enumerate(batch):
        core.add_request(str(i), prompt, GREEDY)
    core.add_request("poison", [3] * 30, GREEDY)

    def execute(real, items):
        if (
            any(item.request_id == "poison" for item in items)
            and core.scheduler.requests["poison"].num_computed_tokens
        ):
            raise RuntimeError("CUDA error: an illegal memory access at 0xdeadbeef")
        return real(items)

    patch_model_steps(monkeypatch, core.runner, execute)
    out = run_to_completion(core)
    poison = out[("poison", 0)][-1]
    assert poison.finish_reason == "error" and poison.error == ENGINE_FAULT
    assert (
        "0xdeadbeef" in caplog.text and "poison" in caplog.text
    )  # the log keeps what the client is not told
    for i, prompt in enumerate(batch):
        assert out[(str(i), 0)][-1].finish_reason == "length"
        assert tokens_of(out[(str(i), 0)]) == alone(tmp_path, prompt, GREEDY)
    assert_all_blocks_idle(core)


def test_a_request_reading_blocks_a_failed_request_was_to_write_fails_too(
    tmp_path, monkeypatch
) -> None:
    """Two identical prompts admitted in one step: the second's prefix hit reads blocks the first
    fills."""
    core = make_core(tmp_path)
    prompt = list(range(3, 23))
    core.add_request("writer", prompt, GREEDY)
    core.add_request("reader", prompt, GREEDY)
    core.add_request("bystander", [5, 6, 7], GREEDY)
    calls = []

    def execute(real, items):
        calls.append(tuple(item.request_id for item in items))
        if "writer" in calls[-1]:
            raise RuntimeError("writer broke")
        return real(items)

    patch_model_steps(monkeypatch, core.runner, execute)
    out = run_to_completion(core)
    assert out[("writer", 0)][-1].finish_reason == "error"
    (reader,) = out[("reader", 0)]
    assert (
        reader.finish_reason == "error"
        and reader.num_cached_tokens > 0
        and not reader.new_token_ids
    )
    assert ("reader",) not in calls  # never run over K/V that was not written
    assert tokens_of(out[("bystander", 0)]) == alone(tmp_path, [5, 6, 7], GREEDY)
    assert_all_blocks_idle(core)


def test_stop_token_and_eos(tmp_path) -> None:
    reference = alone(tmp_path, [3, 4, 5], GREEDY)
    core = make_core(tmp_path)
    core.add_request(
        "s",
        [3, 4, 5],
        SamplingParams(
            max_tokens=12, temperature=0, stop_token_ids=[reference[3]], ignore_eos=True
        ),
    )
    out = run_to_completion(core)[("s", 0)]
    assert (
        tokens_of(out)[-1] == reference[3]
        and out[-1].finish_reason == "stop"
        and out[-1].stop_reason == reference[3]
    )


def test_logprobs_match_log_softmax_of_the_model(tmp_path) -> None:
    core = make_core(tmp_path)
    prompt = [3, 4, 5, 6]
    core.add_request(
        "lp", prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)
    )
    out = run_to_completion(core)[("lp", 0)]
    tokens = tokens_of(out)
    logprobs = [lp for o in out for lp in o.logprobs]
    reference = torch.log_softmax(core.logits(prompt + tokens[:-1]), -1)[len(prompt) - 1 :]
    for row, (token, lp) in enumerate(zip(tokens, logprobs)):
        assert lp.token_id == token and len(lp.top) == 2
        assert lp.logprob == pytest.approx(float(reference[row, token]), abs=1e-4)


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], GREEDY, "prompt"),
        ([VOCAB], GREEDY, "prompt"),
        ([3] * 128, GREEDY, "prompt"),
        ([3] * 120, SamplingParams(max_tokens=9), "max_tokens"),
        ([3], SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
    ],
)
def test_admission_errors(tmp_path, prompt, params, param) -> None:
    core = make_core(tmp_path)
    with pytest.raises(InvalidRequestError) as info:
        core.add_request("x", prompt, params)
    assert info.value.param == param
    assert not core.has_unfinished_requests()


def test_duplicate_request_id_is_refused(tmp_path) -> None:
    core = make_core(tmp_path)
    core.add_request("x", [3], GREEDY)
    with pytest.raises(InvalidRequestError):
        core.add_request("x", [4], GREEDY)


def test_kv_pool_smaller_than_one_sequence_is_a_config_error(tmp_path) -> None:
    with pytest.raises(InvalidRequestError, match="kv_cache_memory"):
        make_core(tmp_path, num_blocks=8)  # 32 slots < max_model_len 128


def test_penalties_see_the_token_history(tmp_path) -> None:
    """The core hands histories to the sampler when (and only when) a penalty needs them."""
    plain = alone(
        tmp_path, [3, 4, 5], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    assert len(set(plain)) < len(plain), "the test needs a greedy run that repeats itself"
    penalised = alone(
        tmp_path,
        [3, 4, 5],
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, presence_penalty=2.0),
    )
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain))


def test_auto_kv_cache_is_float16_for_a_float32_model_on_the_cpu(tmp_path) -> None:
    """As llama.cpp's default f16 cache; a model computing in another dtype stores K/V in it, and a
    GPU keeps the model's dtype."""
    auto = engine_config()
    assert auto.kv_dtype(torch.float32, torch.device("cpu")) == torch.float16
    assert auto.kv_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert auto.kv_dtype(torch.float32, torch.device("cuda")) == torch.float32
    assert (
        engine_config(kv_cache_dtype="float32").kv_dtype(torch.float32, torch.device("cpu"))
        == torch.float32
    )
    assert make_core(tmp_path).runner.kv_cache.keys[0].dtype == torch.float16


@pytest.mark.parametrize("backend", ["torch", "batched"])
def test_float16_kv_cache_holds_twice_the_tokens_and_decodes_alike(tmp_path, backend) -> None:
    """Same memory budget: twice the blocks. Prefill, chunked prefill, prefix hits and decode all
    read the half-precision K/V back: a batch decodes as each prompt alone does, and the logits stay
    within float16 rounding of the float32 cache's (a random tiny model's near-ties may still pick
    other greedy tokens, so those are not compared across dtypes)."""
    batch = [*prompts(6, seed=3), prompts(1, seed=3)[0]]  # the repeat hits the prefix cache
    budget = (
        64 * 4 * kv_bytes_per_token(tiny_config(), torch.float32)
    )  # 64 float32 blocks of 4 tokens
    outputs = {}
    for dtype in ("float32", "float16"):
        core = make_core(
            tmp_path,
            max_num_batched_tokens=24,
            attention_backend=backend,
            kv_cache_dtype=dtype,
            kv_cache_memory=budget,
        )
        outputs[dtype] = core
        for i, prompt in enumerate(batch):
            core.add_request(str(i), prompt, GREEDY)
        core.results = run_to_completion(core)
    wide, narrow = outputs["float32"], outputs["float16"]
    assert wide.runner.kv_cache.keys[0].dtype == torch.float32
    assert narrow.runner.kv_cache.keys[0].dtype == torch.float16
    assert narrow.runner.kv_cache.num_blocks == 2 * wide.runner.kv_cache.num_blocks
    assert narrow.runner.kv_cache.num_bytes == wide.runner.kv_cache.num_bytes
    for i, prompt in enumerate(batch):
        assert tokens_of(narrow.results[(str(i), 0)]) == alone(
            tmp_path, prompt, GREEDY, attention_backend=backend, kv_cache_dtype="float16"
        )
    logits = {name: core.runner.teacher_forced_logits(batch[0]) for name, core in outputs.items()}
    # float16 keeps 11 significant bits: K/V off by ~2^-12 relative move these logits by well under
    # 1%.
    error = (logits["float16"] - logits["float32"]).abs().max() / logits["float32"].abs().max()
    assert 0 < error < 1e-2
