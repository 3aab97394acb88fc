"""Quality on held-out text, SmolLM2 from its GGUF weights (dequantized = the reference).

The targets: int8 within +1% of the reference perplexity; int4-awq within +5% and strictly better
than int4-rtn at the same group size. Group 64 is the int4 setting measured here: the GGUF itself is
Q4_1 with group 32, so int4 at group 32 reproduces its weights exactly (both int4 methods equal the
reference there, and neither can be better than the other), and 128 does not divide the model's
width of 576. Models run as served: int4 and int8 linears on rebar's kernels, activations rounded
to int8 per block of 32.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from markers import requires_smollm2
from suite_tiers import limit

pytestmark = limit("model_quality")  # tests/suite_tiers.py

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
GROUP_SIZE = 64
EVAL_TOKENS = 4096
CONTEXT, STRIDE = 512, 511
CALIB_SEQUENCES = 16


def perplexity_of(model: str | Path, eval_ids: list[int], dequantize: bool = False) -> float:
    from rebar import LLM
    from rebar.eval.perplexity import perplexity

    llm = LLM(model=model, device="cpu", dequantize=dequantize, max_model_len=CONTEXT)
    return perplexity(llm.logits, eval_ids, CONTEXT, STRIDE).perplexity


@pytest.fixture(scope="module")
def perplexities(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    from rebar.eval.perplexity import evaluation_tokens
    from rebar.model.loader import open_checkpoint
    from rebar.quant.quantize import QuantizeSpec, quantize

    eval_ids = evaluation_tokens(
        open_checkpoint("smollm2").tokenizer, CORPUS / "heldout.jsonl", max_tokens=EVAL_TOKENS
    )
    assert len(eval_ids) == EVAL_TOKENS
    folder = tmp_path_factory.mktemp("quality")
    specs = {
        "int8": QuantizeSpec("int8"),
        "int4-rtn": QuantizeSpec("int4-rtn", group_size=GROUP_SIZE),
        "int4-awq": QuantizeSpec(
            "int4-awq",
            group_size=GROUP_SIZE,
            calib_path=CORPUS / "calib.jsonl",
            calib_sequences=CALIB_SEQUENCES,
        ),
    }
    result = {"reference": perplexity_of("smollm2", eval_ids, dequantize=True)}
    for name, spec in specs.items():
        result[name] = perplexity_of(
            quantize("smollm2", spec, folder / name, progress=False).folder, eval_ids
        )
    print(
        "perplexity: "
        + ", ".join(
            f"{name} {value:.3f} ({value / result['reference'] - 1:+.1%})"
            for name, value in result.items()
        )
    )
    return result


def relative(perplexities: dict[str, float], name: str) -> float:
    return perplexities[name] / perplexities["reference"] - 1


@requires_smollm2
def test_int8_is_within_one_percent(perplexities: dict[str, float]) -> None:
    assert relative(perplexities, "int8") <= 0.01, perplexities


@requires_smollm2
def test_activation_aware_int4_beats_round_to_nearest(perplexities: dict[str, float]) -> None:
    assert perplexities["int4-awq"] < perplexities["int4-rtn"], perplexities
    # and by a clear margin: at least four fifths of round-to-nearest's loss is recovered
    assert relative(perplexities, "int4-awq") < 1 / 5 * relative(perplexities, "int4-rtn"), (
        perplexities
    )


@requires_smollm2
def test_activation_aware_int4_is_within_five_percent(perplexities: dict[str, float]) -> None:
    """Measured +2.9% on these 4,096 tokens (16 calibration sequences), against +34.7% for
    int4-rtn (int8: +0.9%).

    Why 4,096 evaluation tokens: the same three checkpoints (an earlier int4-awq build, identical
    up to float rounding) measured int8 +0.85%, int4-rtn +32.0%, int4-awq +3.42% on 8,192 tokens
    and +0.89%, +34.7%, +3.38% on these 4,096: every bound keeps its margin at half the cost. On
    2,048 they measured +1.41%, +37.2%, +3.86%: too few (int8 crosses its 1%)."""
    assert relative(perplexities, "int4-awq") <= 0.05, perplexities
