"""`rebar bench grammar`: what a JSON schema's token masks cost the engine, per decode step.

At each batch size the same requests run three times on one engine: unconstrained, with a JSON
schema (`response_format` as the API gives it, strict), and unconstrained again (the plain figure
is over both plain runs, so drift during the run does not land on one side). The engine's own
histograms give the decode step time of each run and, for the constrained run, the time spent
filling and applying the masks in each step. The mask's share is its mean time over the plain
mean decode step (what structured outputs add to a step, against the step they are added to).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from rebar.engine.core import EngineCore
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.structured import StructuredOutput
from rebar_bench.server_metrics import StepHistogram

# A schema whose outputs run long (at least 40 records), so every constrained request decodes for
# its whole token budget, as the plain ones do: the batch stays full in both runs.
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "city": {"type": "string"},
                    "member": {"type": "boolean"},
                },
                "required": ["name", "age", "city", "member"],
            },
            "minItems": 40,
        }
    },
    "required": ["people"],
}
PROMPT = "List people with their name, age and city as JSON. Person {index}:"


@dataclass(frozen=True)
class GrammarCost:
    batch: int
    output_len: int
    plain_step_ms: float  # mean decode step, unconstrained
    constrained_step_ms: float  # mean decode step with every row constrained
    mask_ms_mean: float  # per step: filling and applying every row's mask
    mask_ms_p50: float
    constrained_tokens: int  # generated in the constrained run (batch x output_len when full)

    @property
    def mask_share(self) -> float:
        return self.mask_ms_mean / self.plain_step_ms

    def row(self) -> str:
        return (
            f"batch {self.batch:>3}: decode step {self.plain_step_ms:7.2f} ms plain, "
            f"{self.constrained_step_ms:7.2f} ms constrained; mask {self.mask_ms_mean:.3f} ms "
            f"mean, {self.mask_ms_p50:.3f} ms p50 = {100 * self.mask_share:.1f}% of a step "
            f"({self.constrained_tokens} tokens)"
        )


def run_grammar_cost(core: EngineCore, batch: int, output_len: int, seed: int = 0) -> GrammarCost:
    spec = StructuredOutput.json_schema(SCHEMA, strict=True)
    before, _, _ = _run(core, batch, output_len, None, seed)
    constrained, masks, tokens = _run(core, batch, output_len, spec, seed)
    after, _, _ = _run(core, batch, output_len, None, seed)
    plain_s = (before.total_s + after.total_s) / max(before.count + after.count, 1)
    return GrammarCost(
        batch=batch,
        output_len=output_len,
        plain_step_ms=1000 * plain_s,
        constrained_step_ms=1000 * (constrained.mean or 0.0),
        mask_ms_mean=1000 * (masks.mean or 0.0),
        mask_ms_p50=1000 * (masks.quantile(0.5) or 0.0),
        constrained_tokens=tokens,
    )


def _run(
    core: EngineCore,
    batch: int,
    output_len: int,
    spec: StructuredOutput | None,
    seed: int,
) -> tuple[StepHistogram, StepHistogram, int]:
    """Decode-step and mask histograms over one run of `batch` requests at once, and the tokens
    generated."""
    steps_before = StepHistogram.of(core.stats().step_seconds["decode"])
    masks_before = StepHistogram.of(core.token_masks.seconds)
    tokenizer = core.tokenizer
    for index in range(batch):
        request_id = f"grammar-bench-{time.monotonic_ns()}-{index}"
        params = SamplingParams(
            max_tokens=output_len,
            temperature=0.8,
            seed=seed + index,
            ignore_eos=True,
            structured=spec,
            speculative=False,  # one token a step: the mask is priced against a plain step
        )
        core.add_request(request_id, tokenizer.encode(PROMPT.format(index=index)), params)
    tokens = 0
    while core.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    steps = StepHistogram.of(core.stats().step_seconds["decode"]).minus(steps_before)
    return steps, StepHistogram.of(core.token_masks.seconds).minus(masks_before), tokens


def to_json(results: list[GrammarCost]) -> str:
    return json.dumps(
        [asdict(r) | {"mask_share": round(r.mask_share, 4)} for r in results], indent=2
    )
