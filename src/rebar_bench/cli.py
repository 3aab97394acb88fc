"""`rebar bench offline | serve | compare | http | grammar | reload | gate | make-model | spec`:
argument parsing and the commands (heavy imports happen only when one runs)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rebar.config.flags import settings_from_flags
from rebar.errors import InvalidRequestError
from rebar_bench.llamacpp import CACHE_TYPES


def _write_json(path: str | None, text: str) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from rebar.llm import LLM
    from rebar_bench.offline import run_offline

    fixed = {"engine.max_num_seqs": max(args.concurrency, 1)}
    llm = LLM.from_settings(args.model, settings_from_flags(args, **fixed))
    core = llm.engine
    if core is None:
        raise InvalidRequestError(
            f"{args.model} is an embedding model; bench offline needs a generator", "model"
        )
    if args.warmup:
        run_offline(
            core,
            num_prompts=1,
            input_len=min(args.input_len, 16),
            output_len=4,
            concurrency=1,
            seed=args.seed + 1,
        )
    result = run_offline(
        core, args.num_prompts, args.input_len, args.output_len, args.concurrency, seed=args.seed
    )
    print(result.table())
    _write_json(args.json, result.to_json())
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from rebar_bench.serve import ServeBenchConfig, parse_concurrency_levels, run_serve_bench

    levels = parse_concurrency_levels(args.concurrency)
    config = ServeBenchConfig(
        url=args.url,
        model=args.model,
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        input_words=args.input_words,
        output_tokens=args.output_tokens,
        seed=args.seed,
        api_key=args.api_key,
        timeout_s=args.timeout,
        ignore_eos=args.ignore_eos,
    )
    logging.getLogger("httpx").setLevel(
        logging.WARNING
    )  # one INFO line per request would drown the progress lines
    report = asyncio.run(run_serve_bench(config, levels))
    print(report.table())
    _write_json(args.json, report.to_json())
    return 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from rebar_bench.compare import CompareConfig, run_compare

    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = CompareConfig(
        model=args.model,
        threads=args.threads,
        repeats=args.repeats,
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        batch=args.batch,
        batch_prompt_tokens=args.batch_prompt_tokens,
        batch_gen_tokens=args.batch_gen_tokens,
        http=not args.no_http,
        concurrency=args.concurrency,
        seed=args.seed,
        decode_target=args.decode_target,
        prefill_target=args.prefill_target,
        batched_target=args.batched_target,
        http_target=args.http_target,
        depth=args.depth,
        depth_gen_tokens=args.depth_gen_tokens,
        depth_target=args.depth_target,
        kv_cache_dtype=args.kv_cache_dtype,
        tools={
            "llama-bench": args.llama_bench,
            "llama-batched-bench": args.llama_batched_bench,
            "llama-server": args.llama_server,
        },
    )
    report = run_compare(config)
    print(report.table())
    _write_json(args.json, report.to_json())
    return 0


def cmd_bench_http(args: argparse.Namespace) -> int:
    from rebar_bench.http_compare import HttpCompareConfig, run_http_compare

    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = HttpCompareConfig(
        model=args.model,
        threads=args.threads,
        tokens=args.tokens,
        seed=args.seed,
        llama_server=args.llama_server,
    )
    report = run_http_compare(config)
    print(report.table())
    _write_json(args.json, report.to_json())
    return 0


def cmd_bench_gate(args: argparse.Namespace) -> int:
    from rebar_bench.gate import run_gate, run_noise

    if args.noise:
        return run_noise(args.model, args.noise, args.threads)
    return run_gate(
        args.model,
        Path(args.baseline),
        update=args.update_baseline,
        threads=args.threads,
        accept_regression=args.accept_regression,
    )


def cmd_bench_make_model(args: argparse.Namespace) -> int:
    from rebar.model.resolve import resolve_model_path
    from rebar_bench.llamacpp import find_tool, quantize
    from rebar_bench.random_gguf import SHAPES, LlamaShape, write_random_llama

    shape = LlamaShape(**SHAPES[args.shape])
    out = Path(args.out)
    f16 = out.with_name(out.stem + "-F16.gguf") if args.type != "F16" else out
    tokenizer = resolve_model_path(args.tokenizer_from)
    print(
        f"writing {f16} ({shape.num_parameters(49152) / 1e9:.2f} B parameters, random F16 weights)"
    )
    write_random_llama(f16, shape, tokenizer, seed=args.seed)
    if args.type != "F16":
        print(f"quantizing to {args.type} with llama.cpp's llama-quantize -> {out}")
        quantize(
            find_tool("llama-quantize", args.llama_quantize), f16, out, args.type, args.threads
        )
        if not args.keep_f16:
            f16.unlink()
    return 0


def cmd_bench_spec(args: argparse.Namespace) -> int:
    from rebar_bench.spec_bench import SpecBenchConfig, run_spec_bench

    config = SpecBenchConfig(
        models=tuple(args.models.split(",")) if args.models else (),
        threads=args.threads,
        tokens=args.tokens,
        ignore_eos=args.ignore_eos,
        rounds=args.rounds,
        batch=args.batch,
        batch_pairs=args.batch_pairs,
        spec_types=tuple(args.spec_types.split(",")),
        big_model=args.big_model,
        draft_model=args.draft_model,
        llama_server=args.llama_server,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run_spec_bench(config)
    print(report.table())
    _write_json(args.json, report.to_json())
    return 0


def cmd_bench_reload(args: argparse.Namespace) -> int:
    from rebar_bench.reload_load import cmd_bench_reload as run

    return run(args)


def cmd_bench_grammar(args: argparse.Namespace) -> int:
    from rebar.llm import LLM
    from rebar_bench.grammar_cost import run_grammar_cost, to_json

    batches = sorted(set(args.batch))
    fixed = {"engine.max_num_seqs": max(batches)}
    llm = LLM.from_settings(args.model, settings_from_flags(args, **fixed))
    core = llm.engine
    if core is None:
        raise llm.not_a_decoder()
    run_grammar_cost(core, 1, 8, seed=args.seed + 999)  # warm-up: kernels, grammar tokenizer
    results = []
    for batch in batches:
        result = run_grammar_cost(core, batch, args.tokens, seed=args.seed)
        print(result.row(), flush=True)
        results.append(result)
    _write_json(args.json, to_json(results))
    return 0


def add_bench_parser(
    commands: Any,
    add_model_args: Callable[..., None],
    positive_int: Callable[[str], int],
) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True
    )
    _add_offline_parser(bench, add_model_args)
    _add_serve_parser(bench)
    _add_compare_parser(bench, positive_int)
    _add_http_parser(bench, positive_int)
    _add_grammar_parser(bench, add_model_args, positive_int)
    _add_reload_parser(bench, positive_int)
    _add_gate_parser(bench, positive_int)
    _add_make_model_parser(bench, positive_int)
    _add_spec_parser(bench, positive_int)


def _add_offline_parser(bench: Any, add_model_args: Callable[..., None]) -> None:
    offline = bench.add_parser(
        "offline", help="engine throughput and latency at a fixed concurrency"
    )
    add_model_args(offline, skip={"max_num_seqs"})  # --concurrency sets it
    offline.add_argument("--num-prompts", type=int, default=16)
    offline.add_argument("--input-len", type=int, default=128)
    offline.add_argument("--output-len", type=int, default=64)
    offline.add_argument(
        "--concurrency", type=int, default=1, help="requests at once (sets --max-num-seqs)"
    )
    offline.add_argument("--seed", type=int, default=0)
    offline.add_argument("--no-warmup", dest="warmup", action="store_false")
    offline.add_argument("--json", default=None, help="also write the result as JSON to this file")
    offline.set_defaults(handler=cmd_bench_offline)


def _add_serve_parser(bench: Any) -> None:
    serve = bench.add_parser(
        "serve", help="streaming latency and throughput of any OpenAI-compatible server"
    )
    serve.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    serve.add_argument(
        "--model", default=None, help="model name to request (default: the first from /v1/models)"
    )
    serve.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    serve.add_argument(
        "--concurrency", default="1,4,16", help="comma-separated concurrency levels, run in order"
    )
    serve.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency level")
    serve.add_argument("--input-words", type=int, default=128, help="words per prompt")
    serve.add_argument("--output-tokens", type=int, default=128, help="max_tokens of every request")
    serve.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos=true (an extension vLLM and llama.cpp accept)",
    )
    serve.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    serve.add_argument("--seed", type=int, default=0, help="seed of the prompt generator")
    serve.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before one request counts as failed"
    )
    serve.add_argument(
        "--json", default=None, help="also write the results (one object per level) to this file"
    )
    serve.set_defaults(handler=cmd_bench_serve)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _add_compare_parser(bench: Any, positive_int: Callable[[str], int]) -> None:
    compare = bench.add_parser(
        "compare", help="rebar (defaults) vs llama.cpp's own tools on the same GGUF; ratios"
    )
    compare.add_argument("--model", default="smollm2", help="a GGUF model (alias or path)")
    compare.add_argument("--threads", type=positive_int, default=2)
    compare.add_argument(
        "--repeats", type=positive_int, default=3, help="runs per figure (the median is reported)"
    )
    compare.add_argument(
        "--prompt-tokens", type=positive_int, default=512, help="prefill length (llama-bench -p)"
    )
    compare.add_argument(
        "--gen-tokens", type=positive_int, default=128, help="decode length (llama-bench -n)"
    )
    compare.add_argument(
        "--batch", type=positive_int, default=16, help="streams of the batched decode (-npl)"
    )
    compare.add_argument(
        "--batch-prompt-tokens", type=positive_int, default=90, help="their prompt length (-npp)"
    )
    compare.add_argument(
        "--batch-gen-tokens", type=positive_int, default=64, help="their output length (-ntg)"
    )
    compare.add_argument(
        "--concurrency", type=positive_int, default=16, help="HTTP streams (llama-server -np)"
    )
    compare.add_argument("--no-http", action="store_true", help="skip the HTTP figures")
    compare.add_argument(
        "--depth",
        type=_non_negative_int,
        default=0,
        help="also decode after this many tokens of context (llama-bench -d; 0: not measured)",
    )
    compare.add_argument(
        "--depth-gen-tokens", type=positive_int, default=32, help="its output length (-n)"
    )
    compare.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=sorted(CACHE_TYPES),
        help="rebar's [engine] kv_cache_dtype, and llama.cpp's -ctk/-ctv to match "
        "(default: each one's own default, float16)",
    )
    _add_targets_and_tools(compare)
    compare.add_argument("--seed", type=int, default=0)
    compare.add_argument("--json", default=None, help="also write the report as JSON to this file")
    compare.set_defaults(handler=cmd_bench_compare)


def _add_targets_and_tools(compare: Any) -> None:
    """The compare's ratio targets and the paths of llama.cpp's tools."""
    targets = ("decode", "prefill", "batched", "http", "depth")
    for name, default in ((name, 1.0) for name in targets):
        compare.add_argument(
            f"--{name}-target",
            type=float,
            default=default,
            help=f"rebar / llama.cpp ratio the {name} figure must reach (default {default})",
        )
    for tool in ("llama-bench", "llama-batched-bench", "llama-server"):
        compare.add_argument(
            f"--{tool}",
            default=None,
            help=f"path of {tool} (default: found, see rebar_bench.llamacpp)",
        )


def _add_http_parser(bench: Any, positive_int: Callable[[str], int]) -> None:
    http = bench.add_parser(
        "http",
        help="the HTTP serving path against llama-server at 1, 16 and 64 streams",
        description=(
            "Starts `rebar serve` with its defaults, then llama.cpp's llama-server on the same "
            "GGUF and threads, and streams the same load to each (rebar bench serve's client): "
            "1 stream (inter-token p50 against rebar's own step, tokens/s), 16 streams "
            "(tokens/s, p95 TTFT) and 64 streams (errors, tokens/s, inter-token p95 / p50)."
        ),
    )
    http.add_argument("--model", default="smollm2", help="alias or GGUF path (default smollm2)")
    http.add_argument("--threads", type=positive_int, default=2)
    http.add_argument("--tokens", type=positive_int, default=128, help="tokens per request")
    http.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    http.add_argument("--llama-server", default=None, help="path of llama-server")
    http.add_argument("--json", default=None, help="also write the report as JSON to this file")
    http.set_defaults(handler=cmd_bench_http)


def _add_grammar_parser(
    bench: Any,
    add_model_args: Callable[..., None],
    positive_int: Callable[[str], int],
) -> None:
    grammar = bench.add_parser(
        "grammar",
        help="what structured outputs' token masks cost per decode step",
        description=(
            "Runs the same sampled requests without and with a JSON schema at each batch size "
            "and reports the engine's mean decode step for both and the time its token masks "
            "took per step (filling and applying them), as a share of the plain step."
        ),
    )
    add_model_args(grammar, skip={"max_num_seqs"})  # the largest --batch sets it
    grammar.add_argument(
        "--batch", type=positive_int, nargs="+", default=[1, 16], help="batch sizes (1 16)"
    )
    grammar.add_argument("--tokens", type=positive_int, default=128, help="tokens per request")
    grammar.add_argument("--seed", type=int, default=0)
    grammar.add_argument("--json", default=None, help="also write the results as JSON to this file")
    grammar.set_defaults(handler=cmd_bench_grammar)


def _add_gate_parser(bench: Any, positive_int: Callable[[str], int]) -> None:
    gate = bench.add_parser(
        "gate",
        help="CI performance gate: what `make run` serves, against a committed baseline",
        description=(
            "Measures the chat model as `make run` serves it (default settings: quantized GGUF "
            "weights, the fused decode step, the default thread count): cold start, prefill, "
            "decode, batched decode, p95 latency (each divided by a calibration run in the same "
            "process) and peak private memory, and fails on a figure beyond its tolerance of the "
            "baseline (a run with one beyond it is followed by two more, and the medians of the "
            "three are judged, as the baseline records them)."
        ),
        epilog=(
            "Re-baselining: on a quiet machine (nothing else running), at the commit to record, "
            "run `rebar bench gate --update-baseline`. It measures, judges the result against the "
            "current baseline and refuses to write a regression unless --accept-regression "
            "'REASON' says why it is accepted; the file records the machine, the commit, the "
            "thread count, the workload and any accepted regression. Then run the gate twice: "
            "both runs must pass. Details: docs/benchmarks.md."
        ),
    )
    gate.add_argument("--model", default="smollm2")
    gate.add_argument(
        "--baseline", default="perf/baseline.json", help="committed baseline (normalised figures)"
    )
    gate.add_argument(
        "--update-baseline",
        action="store_true",
        help="measure and write the baseline; refused when it regresses (see below)",
    )
    gate.add_argument(
        "--accept-regression",
        default=None,
        metavar="REASON",
        help="with --update-baseline: write it despite a regression; REASON is recorded",
    )
    gate.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads (default: torch's default, "
        "as `make run` uses; must match the baseline)",
    )
    gate.add_argument(
        "--noise",
        type=positive_int,
        default=0,
        metavar="RUNS",
        help="measure RUNS times, judge nothing and print each figure's spread (the noise model "
        "the tolerances rest on)",
    )
    gate.set_defaults(handler=cmd_bench_gate)


def _add_make_model_parser(bench: Any, positive_int: Callable[[str], int]) -> None:
    make = bench.add_parser(
        "make-model", help="a random-weight Llama-shaped GGUF (for speed and memory benchmarks)"
    )
    make.add_argument("--shape", default="1b", choices=["135m", "1b", "3b", "8b"])
    make.add_argument("--type", default="Q4_K_M", help="llama-quantize type (F16: no quantization)")
    make.add_argument("--out", required=True, help="the .gguf file to write")
    make.add_argument(
        "--tokenizer-from", default="smollm2", help="a GGUF whose tokenizer the model gets"
    )
    make.add_argument(
        "--llama-quantize", default=None, help="path of llama-quantize (default: found)"
    )
    make.add_argument("--threads", type=positive_int, default=2)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--keep-f16", action="store_true", help="keep the intermediate F16 file")
    make.set_defaults(handler=cmd_bench_make_model)


def _add_spec_parser(bench: Any, positive_int: Callable[[str], int]) -> None:
    spec = bench.add_parser(
        "spec",
        help="speculative decoding against rebar without it and llama-server's n-gram types",
        description=(
            "Starts rebar (defaults, and speculative = false) and llama-server (no speculation, "
            "and each --spec-types type) at once on the same GGUF and threads, and sends each "
            "request to every one in turn (the order rotated each round): grounded requests (a "
            "function rewritten, sentences extracted, a passage summarised) and a free-form "
            "chat, greedy, one stream; rebar also --batch chats at once. --big-model (a "
            "random-weight GGUF) runs free-form chats with and without speculation, and with "
            "--draft-model drafting it (docs/speculative.md)."
        ),
    )
    spec.add_argument("--models", default="smollm2,gemma3", help="comma-separated; '' for none")
    spec.add_argument("--threads", type=positive_int, default=2)
    spec.add_argument("--tokens", type=positive_int, default=256, help="most new tokens an answer")
    spec.add_argument(
        "--ignore-eos", action="store_true", help="generate --tokens always (past the answer's end)"
    )
    spec.add_argument("--rounds", type=positive_int, default=2, help="every server, this often")
    spec.add_argument("--batch", type=positive_int, default=16, help="streams at once (rebar)")
    spec.add_argument(
        "--batch-pairs",
        type=positive_int,
        default=2,
        help="pairs of --batch runs (with and without speculation) a round",
    )
    spec.add_argument(
        "--spec-types",
        default="ngram-simple,ngram-map-k,ngram-mod",
        help="llama-server --spec-type values to compare against",
    )
    spec.add_argument("--big-model", default=None, help="a random-weight GGUF (make-model 1b)")
    spec.add_argument("--draft-model", default=None, help="drafts for --big-model (135m)")
    spec.add_argument("--llama-server", default=None, help="path of llama-server")
    spec.add_argument("--json", default=None, help="also write the report as JSON to this file")
    spec.set_defaults(handler=cmd_bench_spec)


def _add_reload_parser(bench: Any, positive_int: Callable[[str], int]) -> None:
    reload = bench.add_parser(
        "reload",
        help="hot reloads under streaming load across server processes sharing a Redis",
        description=(
            "Starts --servers `rebar serve` processes on one Redis, streams chat completions "
            "from --streams clients, reloads the model --reloads times (each asked of the next "
            "process) and reports failures, streams that saw two versions, the swap times, the "
            "chunk gaps clients saw and each process's memory before, during and after."
        ),
    )
    reload.add_argument("--model", default="smollm2", help="what each `rebar serve` serves")
    reload.add_argument("--redis-url", required=True, help="the Redis every process shares")
    reload.add_argument("--servers", type=positive_int, default=2, help="server processes (2)")
    reload.add_argument("--streams", type=positive_int, default=16, help="concurrent streams")
    reload.add_argument("--reloads", type=positive_int, default=3)
    reload.add_argument("--interval", type=float, default=2.0, help="seconds between reloads")
    reload.add_argument("--tokens", type=positive_int, default=64, help="tokens per answer")
    reload.add_argument("--threads", type=positive_int, default=None, help="torch threads each")
    reload.add_argument("--json", default=None, help="also write the report as JSON to this file")
    reload.set_defaults(handler=cmd_bench_reload)
