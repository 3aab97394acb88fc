"""Speculative decoding on a tiny random model: every output equals decoding without drafts.

The reference is the same engine with `speculative=False`. (The tiny float model runs the model's
own path, where round-off depends on how many rows share a matmul, and its float16 KV cache can
round such a difference up to a few 1e-4: tokens are equal, logprobs close; on the quantized fused
path everything is equal to the bit, test_speculative_quantized.py.) The drafter under test is an oracle
that knows the reference answer and proposes it with a wrong token planted at a position that moves
from step to step, so every step's verdict differs: all drafts kept, none kept, a few kept. The cost
curve is flat (drafts look free), so the policy drafts every slot it may and every path runs. The
core checks its blocks after every step (`run_to_completion`): no block a rejected draft used
outlives its step, and the prefix cache only ever holds blocks of kept tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest

from rebar.engine.core import EngineCore
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.scheduler import ScheduledRequest
from rebar.engine.spec.ngram import NgramDrafter
from rebar.engine.spec.policy import StepCost
from rebar.engine.spec.speculator import Drafting, Speculator
from rebar.engine.structured import StructuredOutput
from tiny_engine import VOCAB, make_core, run_to_completion, tokens_of

FREE = StepCost([(1, 1.0), (2, 1.0)])  # a step costs the same whatever it computes
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


class OracleDrafter:
    """Proposes each request's reference continuation, one token of it made wrong (at a position
    that depends on how far the request got), so verdicts vary from all kept to none."""

    name = "oracle"

    def __init__(self, references: dict[str, list[int]]) -> None:
        self.references = references
        self.num_proposed = 0

    def outlook(self, sequence: Drafting, max_tokens: int) -> int:
        request = sequence.request
        reference = self.references.get(request.request_id, [])
        done = request.num_output_tokens
        proposal = list(reference[done : done + max_tokens])
        wrong = (done * 7) % (max_tokens + 2)
        if wrong < len(proposal):
            proposal[wrong] = (proposal[wrong] + 1) % VOCAB
        sequence.speculation.planned = tuple(proposal)
        return len(proposal)

    def draft(self, batch: Sequence[tuple[Drafting, ScheduledRequest]]) -> list[tuple[int, ...]]:
        self.num_proposed += sum(item.num_lookahead for _, item in batch)
        return [sequence.speculation.planned[: item.num_lookahead] for sequence, item in batch]


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        core.add_request(request_id, prompt, params)
    return run_to_completion(core)


def reference_and_speculative(
    tmp_path, requests: dict[str, tuple[list[int], SamplingParams]], **engine: object
) -> tuple[dict, dict, EngineCore]:
    """Outputs without drafts, and with the oracle drafting against them."""
    plain = run(make_core(tmp_path, speculative=False, **engine), requests)
    references = {
        request_id if requests[request_id][1].n == 1 else f"{request_id}#{index}": tokens_of(
            outputs
        )
        for (request_id, index), outputs in plain.items()
    }
    core = make_core(tmp_path, **engine)
    core.speculator = Speculator(OracleDrafter(references), FREE, max_draft_tokens=5)
    return plain, run(core, requests), core


def assert_same_outputs(plain: dict, speculative: dict) -> None:
    assert speculative.keys() == plain.keys()
    for key, outputs in plain.items():
        ours = speculative[key]
        assert tokens_of(ours) == tokens_of(outputs), key
        assert "".join(o.text_delta for o in ours) == "".join(o.text_delta for o in outputs)
        assert ours[-1].finish_reason == outputs[-1].finish_reason
        assert ours[-1].stop_reason == outputs[-1].stop_reason
        ours_logprobs = [lp for o in ours for lp in o.logprobs]
        reference = [lp for o in outputs for lp in o.logprobs]
        assert len(ours_logprobs) == len(reference)
        for mine, theirs in zip(ours_logprobs, reference):
            assert mine.token_id == theirs.token_id
            assert mine.logprob == pytest.approx(theirs.logprob, abs=2e-3)
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def assert_drafts_were_checked(core: EngineCore) -> None:
    counts = core.stats().drafts["oracle"]
    assert counts.num_drafted > 20
    assert 0 < counts.num_accepted < counts.num_drafted  # some kept, some refused
    assert core.kv_manager.pool.num_free_blocks == core.kv_manager.pool.num_blocks


def test_greedy_batch_with_chunked_prefill_equals_decoding_without_drafts(tmp_path) -> None:
    requests = {str(i): (prompt, GREEDY) for i, prompt in enumerate(prompts(6))}
    plain, speculative, core = reference_and_speculative(
        tmp_path, requests, max_num_batched_tokens=20
    )
    assert_same_outputs(plain, speculative)
    assert_drafts_were_checked(core)


def test_seeded_sampling_penalties_logprobs_and_n_give_the_same_tokens(
    tmp_path, eager_drafts
) -> None:
    requests = {
        "seeded": (prompts(1, 1)[0], SamplingParams(max_tokens=20, temperature=0.9, seed=7)),
        "top": (
            prompts(1, 2)[0],
            SamplingParams(max_tokens=20, temperature=1.2, top_k=20, top_p=0.9, seed=3, n=3),
        ),
        "penalised": (
            prompts(1, 3)[0],
            SamplingParams(
                max_tokens=20,
                temperature=0.7,
                seed=11,
                presence_penalty=0.8,
                frequency_penalty=0.3,
                repetition_penalty=1.3,
                logit_bias={5: 2.0, 9: -3.0},
            ),
        ),
        "logprobs": (prompts(1, 4)[0], SamplingParams(max_tokens=20, temperature=0, logprobs=3)),
    }
    plain, speculative, core = reference_and_speculative(tmp_path, requests)
    assert_same_outputs(plain, speculative)
    assert_drafts_were_checked(core)


def test_stop_strings_stop_tokens_and_max_tokens_end_where_they_would(tmp_path) -> None:
    base = prompts(4, 5)
    first = run(make_core(tmp_path, speculative=False), {"probe": (base[0], GREEDY)})
    probe = tokens_of(first[("probe", 0)])
    requests = {
        # A stop token and a stop string that occur mid-answer, where drafts reach past them.
        "stop-token": (
            base[0],
            SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(probe[6],)),
        ),
        "stop-string": (
            base[0],
            SamplingParams(max_tokens=24, temperature=0, stop=[f"w{probe[9]}"]),
        ),
        "max-tokens": (base[1], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)),
        "one-token": (base[2], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)),
        "eos": (base[3], SamplingParams(max_tokens=24, temperature=0)),
    }
    plain, speculative, _ = reference_and_speculative(tmp_path, requests)
    assert_same_outputs(plain, speculative)
    assert len(tokens_of(speculative[("max-tokens", 0)])) == 7
    assert speculative[("stop-token", 0)][-1].stop_reason == probe[6]


def test_preemption_and_prefix_cache_hits_give_the_same_tokens(tmp_path, eager_drafts) -> None:
    shared = list(range(2, 22))
    requests = {
        str(i): (shared + prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        for i, prompt in enumerate(prompts(8, 8))
    }
    # 32 blocks of 4 tokens for eight requests of 50 to 80 tokens: preemptions are certain.
    plain, speculative, core = reference_and_speculative(tmp_path, requests, num_blocks=32)
    assert_same_outputs(plain, speculative)
    assert_drafts_were_checked(core)
    assert core.stats().num_preemptions > 0
    assert core.stats().num_prefix_hits > 0


def test_structured_outputs_follow_the_grammar_and_equal_decoding_without_drafts(
    tmp_path, eager_drafts
) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    structured = StructuredOutput.json_schema(schema, strict=True)
    requests = {
        f"json{i}": (
            prompt,
            SamplingParams(max_tokens=60, temperature=0.8, seed=i, structured=structured),
        )
        for i, prompt in enumerate(prompts(3, 9))
    }
    plain, speculative, core = reference_and_speculative(tmp_path, requests, characters=True)
    assert_same_outputs(plain, speculative)
    for key, outputs in speculative.items():
        text = "".join(o.text_delta for o in outputs)
        if outputs[-1].finish_reason == "stop":
            assert set(json.loads(text)) == {"name", "age"}, key
    assert core.stats().drafts["oracle"].num_accepted > 0


def test_a_request_can_opt_out(tmp_path) -> None:
    prompt = prompts(1, 10)[0]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculative=False)
    plain, speculative, core = reference_and_speculative(tmp_path, {"out": (prompt, params)})
    assert_same_outputs(plain, speculative)
    assert core.stats().drafts["oracle"].num_drafted == 0


def test_opting_out_must_be_a_boolean() -> None:
    with pytest.raises(Exception, match="speculative must be a boolean"):
        SamplingParams(speculative="no")  # type: ignore[arg-type]


def test_ngram_drafts_in_the_engine_change_no_token(tmp_path, eager_drafts) -> None:
    """The n-gram drafter on long greedy answers: drafts are made and checked (a random model
    rarely repeats itself, so few hold; test_speculative_smollm2.py has a model that copies)."""
    requests = {
        str(i): (prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        for i, prompt in enumerate(prompts(4, 12))
    }
    engine = {"max_model_len": 256, "num_blocks": 128}
    core = make_core(tmp_path, **engine)
    core.speculator = Speculator(NgramDrafter(), FREE, max_draft_tokens=8)
    speculative = run(core, requests)
    plain = run(make_core(tmp_path, speculative=False, **engine), requests)
    assert_same_outputs(plain, speculative)
    counts = core.stats().drafts["ngram"]
    assert counts.num_drafted > 100 and counts.num_accepted > 0
