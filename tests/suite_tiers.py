"""The suite's two tiers and its time limits.

`make check` runs the fast tier (`-m "not full"`): every test file except those FULL_ONLY names,
alone or through a folder above them. `make test`, and CI, run everything. What each file costs is
recorded in tests/durations.json (seconds per file, its fixtures' setup included, from a full run
under the exclusive CPU lock: scripts/suite_durations.py), and tests/test_suite_rules.py keeps the
tiers honest against it: every test file has a recorded cost, every file slower than the slow-file
bound is full-only, every FULL_ONLY entry exists, and the fast tier's recorded total fits its
budget.

Every test has a time limit (pytest-timeout): DEFAULT_LIMIT_S, pyproject's `timeout`, unless its
file carries one of the named LIMITS_S (pytestmark = limit("...")), so a hang fails within minutes
with every thread's stack instead of stalling CI to its own limit.
"""

from __future__ import annotations

import pytest

MARKER = "full"  # the marker of full-only tests (added at collection, from FULL_ONLY)

# Test files (or folders) that only the full suite runs, each with why.
FULL_ONLY: dict[str, str] = {
    "reliability/": "the soak, the fuzzers and the fault injections: minutes of load",
    "ray/": "a local Ray cluster",
    "web/": "Chromium driving the chat page",
    "quant/test_quality_smollm2.py": "AWQ and perplexity on the real model (about 2 minutes)",
    "quant/test_awq.py": "AWQ scale searches",
    "quant/test_quant_cli.py": "quantizes and evaluates the real model through the command line",
    "quant/test_gguf_quantized.py": "every GGUF weight kind through the kernels on real shapes",
    "test_cli.py": "`rebar` processes: chat, generate, profile, inspect",
    "server/test_serve_process.py": "`rebar serve` processes: drain, crash, bad settings",
    "server/test_reload_redis.py": "two `rebar serve` processes reloading over Redis",
    "server/test_redis_failover.py": "`rebar serve` processes sharing a Redis that crashes",
    "server/test_cache_and_limits.py": "every cache and limit against both stores, live servers",
    "server/test_model_serving.py": "several models, budgets and reloads under load",
    "model/test_gemma3_vs_transformers.py": "Gemma 3 through transformers' own float path",
    "bench/test_compare.py": "a real comparison run against llama.cpp's output",
    "kernels/test_cpu_quant_kinds.py": "builds the AVX2 kernels beside this CPU's to compare them",
    "kernels/test_triton_attention.py": "Triton's CPU interpreter, in a subprocess",
    "kernels/test_triton_quant_matmul.py": "Triton's CPU interpreter, in a subprocess",
    "model/test_hf_parity.py": "transformers' models as the reference, many configurations",
    "model/test_gemma3_vs_llamacpp.py": "Gemma 3 loaded for llama.cpp's fixtures",
    "engine/test_speculative.py": "speculation against plain decoding, many engines of a tiny model",
    "engine/test_spec_draft_model.py": "draft models, with a chi-square over thousands of draws",
    "engine/test_spec_distribution.py": "chi-square checks over thousands of seeded draws",
    "engine/test_speculative_real_models.py": "SmolLM2 and Gemma 3 with and without speculation",
    "engine/test_prefix_cache_exactness.py": "SmolLM2 and Gemma 3 cold, after hits and chunked",
    "engine/test_contract.py": "loads every bundled model to check its contract",
    "server/test_hostile_inputs.py": "one live server per attack's settings",
    "server/test_structured_outputs.py": "grammar-constrained generation through a live server",
    "server/test_tool_calling.py": "grammar-constrained tool calls through a live server",
    "server/test_langchain.py": "LangChain against a live server and the chat route",
    "server/test_request_path.py": "traces a request of every route through a live server",
    "server/test_responses.py": "the Responses API through a live server, background runs too",
    "server/test_responses_mcp.py": "MCP tool loops through a live server and two MCP servers",
    "test_example_agent_flow.py": "the Agents SDK example against a live server and its MCP server",
    "server/test_anthropic.py": "Anthropic's SDK against a live server with API keys on",
    "server/test_agents_sdk.py": "an OpenAI Agents SDK run against a live server",
    "server/test_deploy_files.py": "Locust against a live server",
    "server/test_models_cli.py": "`rebar models` processes against a live server",
    "bench/test_gate.py": "the real gate on a tiny model: fresh processes and a `rebar serve`",
    "test_openmp_env.py": "fresh Python processes importing torch",
    "documents/test_summarize_api.py": "document summaries through a live server on SmolLM2",
    "documents/test_summarize_cli.py": "`rebar summarize` processes on SmolLM2, Ctrl-C included",
    "desktop/test_desktop_window.py": "`rebar desktop` windows under Xvfb, their servers on SmolLM2",
}
SLOW_FILE_S = 15.0  # a file that costs more is full-only
FAST_BUDGET_S = 180.0  # the fast tier's recorded total: `make check` within 4 minutes with lint

DEFAULT_LIMIT_S = 120  # pyproject's [tool.pytest.ini_options] timeout
# Named larger limits, each a few times the slowest test it covers (tests/durations.json's run).
LIMITS_S: dict[str, int] = {
    "model_quality": 900,  # quantizing the real model (AWQ search, ~3 min) and its perplexity
    "processes": 300,  # starts `rebar` processes (serve, chat, quantize) and waits for their models
    "reference_model": 300,  # a real model through transformers' own float path
    "cluster": 600,  # a local Ray cluster, its replicas and their models
    "browser": 300,  # Chromium, the chat page and a live server
    "soak": 2400,  # the reliability suite's runs (`make reliability`: a 20-minute soak)
    "kernel_build": 900,  # builds another instruction set's C++ kernels from scratch
}


def limit(name: str) -> pytest.MarkDecorator:
    """The time-limit marker named `name` (LIMITS_S)."""
    return pytest.mark.timeout(LIMITS_S[name])


def is_full_only(relative_path: str) -> bool:
    """Whether the test file at `relative_path` (from tests/, "/"-separated) is full-only."""
    return any(
        relative_path == entry or (entry.endswith("/") and relative_path.startswith(entry))
        for entry in FULL_ONLY
    )
