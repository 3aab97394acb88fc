"""Batch equals alone on the quantized fused path: a tiny random Q4_K / Q8_0 GGUF kept quantized,
its decode rows through the fused CPU step, its prompt chunks through the model beside them.

Each request must get exactly the tokens it gets alone, whatever shares its steps, and different
prompts must get different continuations (a step that ignored its input or mixed rows up would
give every request the same answer).
"""

from __future__ import annotations

import random

import pytest
from gguf import GGMLQuantizationType as QT
from gguf_builder import TinyConfig, model_contents, random_hf_state

from needs import need_cpu_kernels, requires
from rebar import LLM
from rebar.engine.sampling_params import SamplingParams
from rebar.llm import engine_config
from tiny_engine import run_to_completion, tokens_of

pytestmark = requires(need_cpu_kernels)

# K-quant rows are whole super-blocks of 256 values: a model that wide.
CONFIG = TinyConfig(arch="llama", hidden=256, heads=4, kv_heads=2, intermediate=512, context=256)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True)


@pytest.fixture(scope="module", params=[QT.Q4_K, QT.Q8_0], ids=lambda q: q.name)
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    storage = request.param
    folder = tmp_path_factory.mktemp(f"batch-{storage.name}")
    contents = model_contents(CONFIG, random_hf_state(CONFIG, seed=3), storage)
    path = contents.write(folder / f"tiny-{storage.name}.gguf")
    # Small steps force chunked prefills beside decodes; no prefix cache, so alone is really alone.
    engine = engine_config(
        block_size=4,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
        kv_cache_memory=2**20,  # ~1k tokens: run_to_completion checks every block after each step
    )
    model = LLM(model=path, device="cpu", engine_config=engine)
    assert model.engine is not None and model.engine.runner.fused_decoder is not None
    return model


class FusedRowsSpy:
    """Wraps the runner's fused decoder and records how many decode rows each call carried."""

    def __init__(self, fused) -> None:
        self.fused, self.rows = fused, []
        self.max_rows = fused.max_rows

    def __call__(self, input_ids, positions, meta):
        self.rows.append(len(input_ids))
        return self.fused(input_ids, positions, meta)


def prompts(llm: LLM, count: int = 8, seed: int = 0) -> list[list[int]]:
    tokenizer = llm.tokenizer
    ordinary = [i for i in range(tokenizer.vocab_size) if not tokenizer.is_special(i)]
    rng = random.Random(seed)
    return [[rng.choice(ordinary) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def generate(llm: LLM, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    core = llm.engine
    for i, prompt in enumerate(batch):
        core.add_request(str(i), prompt, params)
    outputs = run_to_completion(core)
    return [tokens_of(outputs[(str(i), 0)]) for i in range(len(batch))]


@pytest.fixture
def spy(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> FusedRowsSpy:
    runner = llm.engine.runner
    spy = FusedRowsSpy(runner.fused_decoder)
    monkeypatch.setattr(runner, "fused_decoder", spy)
    return spy


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_equals_one_at_a_time(llm: LLM, spy: FusedRowsSpy, params) -> None:
    batch = prompts(llm)
    together = generate(llm, batch, params)
    assert max(spy.rows) > 1, "the batch never reached the fused step together"
    alone = [generate(llm, [prompt], params)[0] for prompt in batch]
    assert together == alone
    assert all(len(tokens) == params.max_tokens for tokens in together)


def test_different_prompts_get_different_continuations(llm: LLM, spy: FusedRowsSpy) -> None:
    batch = prompts(llm, seed=1)
    together = generate(llm, batch, GREEDY)
    assert spy.rows, "no decode step went through the fused step"
    assert len({tuple(tokens) for tokens in together}) == len(batch)
    assert len({tokens[0] for tokens in together}) > 1, "every prompt got the same first token"
