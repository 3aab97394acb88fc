"""The draft-model drafter: a second model's drafts, its own KV cache mirrored block for block,
and the vocabulary check at load."""

from __future__ import annotations

import pytest
import torch

from markers import need_gemma3, need_smollm2
from needs import requires
from rebar.engine.core import EngineCore
from rebar.engine.engine_config import kv_bytes_per_token
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.spec.draft_model import DraftModel, check_same_vocabulary
from rebar.engine.spec.policy import StepCost
from rebar.errors import ConfigError
from rebar.llm import engine_config
from spec_stats import NUM_DRAWS, chi_square_p_value, draw, exact_distribution
from tiny_engine import VOCAB, run_to_completion, tiny_config, tiny_model, tiny_tokenizer, tokens_of

FREE = StepCost([(1, 1.0), (2, 1.0)])


def core_with_draft(
    tmp_path, draft: DraftModel | None, num_blocks: int = 96, max_num_seqs: int = 32
) -> EngineCore:
    config = tiny_config()
    kv_dtype = torch.float16
    per_token = kv_bytes_per_token(config, kv_dtype)
    if draft is not None:
        per_token += kv_bytes_per_token(draft.config, kv_dtype)
    engine = engine_config(
        block_size=4,
        max_model_len=128,
        kv_cache_memory=num_blocks * 4 * per_token,
        max_num_seqs=max_num_seqs,
        speculative=draft is not None,
    )
    core = EngineCore(
        tiny_model(config),
        config,
        tiny_tokenizer(tmp_path / "tok"),
        engine,
        torch.float32,
        torch.device("cpu"),
        draft,
    )
    if core.speculator is not None:
        core.speculator.cost = FREE  # draft every slot: every path runs
        core.speculator.seconds_per_draft = 0.0
    return core


def generate(core: EngineCore, params: SamplingParams, count: int = 5) -> dict:
    for i in range(count):
        prompt = [(7 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(5 + 3 * i)]
        core.add_request(str(i), prompt, params)
    return {key: tokens_of(outputs) for key, outputs in run_to_completion(core).items()}


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["the-model-itself", "another-model"])
def test_greedy_drafted_outputs_equal_decoding_without_drafts(
    tmp_path, draft_seed, eager_drafts
) -> None:
    """Drafted by the model itself (its drafts hold) or by another random model (they rarely do,
    and the small pool preempts): greedy tokens are those of decoding alone."""
    draft_config = tiny_config() if draft_seed == 0 else tiny_config(num_layers=1, hidden_size=32)
    draft = DraftModel("tiny-draft", tiny_model(draft_config, seed=draft_seed), draft_config)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = generate(core_with_draft(tmp_path, None, num_blocks=40), params)
    core = core_with_draft(tmp_path, draft, num_blocks=40)
    assert generate(core, params) == plain
    counts = core.stats().drafts["draft_model"]
    assert counts.num_drafted > 50
    if draft_seed == 0:
        assert counts.num_accepted > 0.9 * counts.num_drafted
    else:
        # Drafts that fail leave sequences growing a token a step: the pool runs short. (Drafts
        # that hold finish them in a few steps, and draft slots only ever take blocks nobody
        # else needs, so the model drafting for itself never preempts.)
        assert core.stats().num_preemptions > 0


def test_sampled_drafts_follow_the_model_distribution_and_replay_with_a_seed(tmp_path) -> None:
    """A sampled request's drafts are drawn from the draft model and checked by rejection
    sampling: the output follows the model's distribution (chi-square against the exact one), and
    the same seed gives the same tokens again (not those of decoding without drafts). The draft is
    the model with noise added to its weights: close enough that many drafts hold, not all."""
    draft_config = tiny_config()
    module = tiny_model(draft_config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for weight in module.parameters():
            weight.add_(0.05 * torch.randn(weight.shape, generator=generator))
    draft = DraftModel("noisy-self", module, draft_config)
    core = core_with_draft(tmp_path, draft, num_blocks=512, max_num_seqs=64)
    observed = draw(core)
    counts = core.stats().drafts["draft_model"]
    assert counts.num_accepted > 300 and counts.num_drafted - counts.num_accepted > 300
    assert chi_square_p_value(observed, exact_distribution(core), NUM_DRAWS) > 1e-6

    params = SamplingParams(max_tokens=30, temperature=0.9, seed=4, ignore_eos=True)
    again = core_with_draft(tmp_path, draft)
    assert generate(again, params) == generate(core_with_draft(tmp_path, draft), params)


def test_a_draft_with_another_vocabulary_is_refused_naming_the_difference(tmp_path) -> None:
    config = tiny_config()
    words = tiny_tokenizer(tmp_path / "words")
    characters = tiny_tokenizer(tmp_path / "characters", characters=True)
    expected = "token 2 is 'Ġ' in the draft model's vocabulary and 'w2' in the model's"
    with pytest.raises(ConfigError, match=expected):
        check_same_vocabulary("model", words, config, "draft", characters, config)
    wider = tiny_config(vocab_size=VOCAB + 32)
    with pytest.raises(ConfigError, match=f"it scores {VOCAB + 32} token ids, the model {VOCAB}"):
        check_same_vocabulary("model", words, config, "draft", words, wider)
    check_same_vocabulary("model", words, config, "draft", words, config)  # the same: accepted


@requires(need_smollm2)
@requires(need_gemma3)
def test_loading_a_draft_of_another_family_fails_before_its_weights_load() -> None:
    from rebar import LLM

    with pytest.raises(ConfigError, match="its vocabulary has 262144 tokens, the model's 49152"):
        LLM("smollm2", engine_config=engine_config(draft_model="gemma3", speculative=True))


@requires(need_smollm2)
def test_a_draft_model_without_speculation_is_refused_not_ignored() -> None:
    from rebar import LLM

    with pytest.raises(
        ConfigError, match="draft_model smollm2 is set but speculative decoding is off"
    ):
        LLM("smollm2", engine_config=engine_config(draft_model="smollm2", speculative=False))
