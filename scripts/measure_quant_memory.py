"""Resident memory of a model loaded by rebar, each in a fresh process (dev tool).

For every `LABEL=MODEL[:dequantize]` argument, a child process imports rebar, loads the model on the
CPU in float32, generates 16 tokens, and reports its resident set (VmRSS) and peak (VmHWM) from
/proc/self/status, next to the same for a process that only imported torch and rebar.

    PYTHONPATH=src python scripts/measure_quant_memory.py reference=smollm2:dequantize \
        gguf-q4_1=smollm2 int8=/tmp/smollm2-int8 int4-awq=/tmp/smollm2-awq
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import json, sys
import torch
from rebar import LLM, SamplingParams

def status():
    values = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values

model, how = sys.argv[1], sys.argv[2]
if model == "-":
    print(json.dumps(status()))
    raise SystemExit
llm = LLM(model=model, device="cpu", dequantize=how == "dequantize", max_model_len=256, \
kv_cache_memory=16 * 2**20)
llm.generate("The capital of France is", \
SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
print(json.dumps(status()))
"""


LOAD_FLAGS = (
    "",
    "dequantize",
)  # how the model is loaded: as it comes (quantized weights kept), or expanded


def measure(model: str, how: str) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, model, how], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    baseline = measure("-", "")
    print(f"import torch + rebar: {baseline['VmRSS']:.0f} MiB resident\n")
    print("| model | resident (MiB) | peak (MiB) | above the import baseline (MiB) |")
    print("|---|---|---|---|")
    for argument in sys.argv[1:]:
        label, _, spec = argument.partition("=")
        model, _, flag = spec.partition(":")
        if flag not in LOAD_FLAGS:
            raise SystemExit(
                f"{argument}: unknown flag {flag!r}; use one of "
                f"{', '.join(f for f in LOAD_FLAGS if f)}"
            )
        values = measure(model, flag)
        print(
            f"| {label} | {values['VmRSS']:.0f} | {values['VmHWM']:.0f} "
            f"| {values['VmRSS'] - baseline['VmRSS']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
