"""The `rebar` command: generate, chat, serve, inspect, quantize, eval, bench, profile, config."""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from rebar.errors import InvalidRequestError, RebarError
from rebar.eval.cli import add_eval_parser
from rebar.quant.cli import add_quantize_parser

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")  # engine.kv_cache_dtype's values


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="alias (smollm2, minilm), a .gguf file or an HF folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dequantize", action="store_true", help="expand quantized weights to --dtype at load (the float reference)")
    parser.add_argument("--quantized-gguf", action="store_true",
                        help="run GGUF Q4_0/Q4_1/Q8_0 weights quantized (int4/int8 kernels) instead of as float")


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from rebar.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _load(args: argparse.Namespace):
    from rebar.engine.llm import LLM

    return LLM(model=args.model, dtype=args.dtype, device=args.device, dequantize=args.dequantize,
               quantized_gguf=args.quantized_gguf)


def _stream_to_stdout(llm, prompt: str, params) -> str:
    text = []
    for step in llm.stream([prompt], params):
        sys.stdout.write(step.text_delta)
        sys.stdout.flush()
        text.append(step.text_delta)
    sys.stdout.write("\n")
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # validate before the (slow) load
    llm = _load(args)
    _stream_to_stdout(llm, args.prompt, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load(args)
    print(f"rebar chat — {args.model} loaded in {llm.load_seconds:.1f}s. /reset clears, /exit or Ctrl-D quits.", file=sys.stderr)
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            answer = _stream_to_stdout(llm, llm.render_chat(messages), params)
        except RebarError as exc:  # e.g. the conversation outgrew the context window
            messages.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": answer})


def cmd_serve(args: argparse.Namespace) -> int:
    from rebar.config import load_settings
    from rebar.obs.logs import configure_logging
    from rebar.server.app import create_app
    from rebar.server.serve import run_server

    overrides = {
        "server.host": args.host, "server.port": args.port, "models.chat": args.model,
        "models.embedding": args.embedding_model, "models.dtype": args.dtype, "models.device": args.device,
        "models.quantized_gguf": True if args.quantized_gguf else None,
        "engine.kv_cache_dtype": args.kv_cache_dtype,
    }
    settings = load_settings(args.config, overrides)
    configure_logging(settings.logging.level, settings.logging.format)
    run_server(create_app(settings), settings.server.host, settings.server.port, settings.server.drain_timeout_s,
               settings.logging.level)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from rebar.model.loader import open_checkpoint

    checkpoint = open_checkpoint(args.model)
    config = checkpoint.config
    print(f"path:          {checkpoint.path}")
    print(f"format:        {checkpoint.format}")
    print(f"architecture:  {config.source_architecture} (runs as {config.architecture})")
    if config.name:
        print(f"name:          {config.name}")
    print("config:")
    skipped = {"name", "source_architecture", "architecture"}
    skipped |= _DECODER_FIELDS if config.architecture == "bert" else _ENCODER_FIELDS
    for key, value in vars(config).items():
        if key not in skipped:
            print(f"  {key}: {value}")
    if checkpoint.metadata:
        print("metadata:")
        for key, value in checkpoint.metadata.items():
            print(f"  {key}: {value}")
    infos = checkpoint.tensors.values()
    num_params = sum(_numel(t.shape) for t in infos)
    num_bytes = sum(t.num_bytes for t in infos)
    storage = Counter(t.storage for t in infos)
    print(f"tensors:       {len(checkpoint.tensors)}, {num_params / 1e6:.1f}M parameters, {num_bytes / 2**20:.1f} MiB stored")
    print("storage types: " + ", ".join(f"{kind} x{count}" for kind, count in storage.most_common()))
    if args.tensors:
        for info in infos:
            print(f"  {info.file_name:48s} {str(list(info.shape)):18s} {info.storage}")
    tokenizer = checkpoint.tokenizer
    special = tokenizer.special
    print(f"tokenizer:     {tokenizer.kind}, vocab {tokenizer.vocab_size}, bos {special.bos_token!r} "
          f"(add_bos={special.add_bos}), eos {[tokenizer.id_to_token(i) for i in special.eos_token_ids]}")
    template = checkpoint.chat_template
    if template is None:
        print("chat template: none")
    else:
        shown = template if args.full_template or len(template) <= 400 else template[:400] + " ..."
        print(f"chat template ({len(template)} chars):\n{shown}")
    return 0


_ENCODER_FIELDS = {"type_vocab_size", "pooling", "normalize_embeddings", "max_seq_length"}
_DECODER_FIELDS = {
    "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "qkv_bias", "o_bias", "mlp_bias",
    "tie_word_embeddings", "sliding_window",
}


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from rebar.bench.offline import run_offline
    from rebar.engine.engine_config import EngineConfig
    from rebar.engine.llm import LLM

    engine_config = EngineConfig(max_num_seqs=max(args.concurrency, 1), max_num_batched_tokens=args.max_num_batched_tokens,
                                 kv_cache_dtype=args.kv_cache_dtype)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, engine_config=engine_config, dequantize=args.dequantize,
              quantized_gguf=args.quantized_gguf)
    core = llm.engine
    if core is None:
        raise InvalidRequestError(f"{args.model} is an embedding model; bench offline needs a generator", "model")
    if args.warmup:
        run_offline(core, num_prompts=1, input_len=min(args.input_len, 16), output_len=4, concurrency=1, seed=args.seed + 1)
    result = run_offline(core, args.num_prompts, args.input_len, args.output_len, args.concurrency, seed=args.seed)
    print(result.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(result.to_json())
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from rebar.bench.serve import ServeBenchConfig, parse_concurrency_levels, run_serve_bench

    levels = parse_concurrency_levels(args.concurrency)
    config = ServeBenchConfig(
        url=args.url, model=args.model, endpoint=args.endpoint, num_prompts=args.num_prompts,
        input_words=args.input_words, output_tokens=args.output_tokens, seed=args.seed,
        api_key=args.api_key, timeout_s=args.timeout, ignore_eos=args.ignore_eos,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the progress lines
    report = asyncio.run(run_serve_bench(config, levels))
    print(report.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(report.to_json())
    return 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from rebar.bench.compare import run_compare

    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run_compare(args.model, args.threads, args.output_len, args.repeats, http=not args.no_http, seed=args.seed,
                         kv_cache_dtype=args.kv_cache_dtype)
    print(report.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(report.to_json())
    return 0


def cmd_bench_gate(args: argparse.Namespace) -> int:
    from rebar.bench.gate import run_gate

    return run_gate(args.model, Path(args.baseline), update=args.update_baseline, threads=args.threads)


def cmd_profile(args: argparse.Namespace) -> int:
    import json

    from rebar.engine.engine_config import EngineConfig
    from rebar.engine.llm import LLM
    from rebar.obs.profiling import profile_engine

    engine_config = EngineConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch * args.input_len))
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, engine_config=engine_config,
              dequantize=args.dequantize, quantized_gguf=args.quantized_gguf)
    if llm.engine is None:
        raise InvalidRequestError(f"{args.model} is an embedding model; profile needs a generator", "model")
    result = profile_engine(llm.engine, args.steps, args.batch, args.input_len, args.warmup_steps, args.top)
    with open(args.output, "w", encoding="utf-8") as out:
        json.dump(result.trace, out)
    print(result.table)
    print(f"{result.num_steps} steps in {result.seconds:.3f}s; Chrome trace written to {args.output} "
          "(open in ui.perfetto.dev or chrome://tracing)")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    import json

    from rebar.config import load_settings, to_toml

    settings = load_settings(args.config)
    num_keys = len(settings.api_key_hashes())  # also proves the key file is readable
    if args.format == "json":
        print(json.dumps(settings.masked_dict(), indent=2))
    else:
        print(to_toml(settings.masked_dict()), end="")
        print(f"# auth: on, {num_keys} distinct key(s)" if num_keys else "# auth: off (no api_keys or api_key_file)")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rebar", description="rebar: LLM inference from first principles")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete a prompt, streaming tokens to stdout")
    _add_model_args(generate)
    _add_sampling_args(generate, max_tokens=128)
    generate.add_argument("prompt")
    generate.set_defaults(handler=cmd_generate)

    chat = commands.add_parser("chat", help="interactive chat using the model's chat template")
    _add_model_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="system prompt (default: the template's own)")
    chat.set_defaults(handler=cmd_chat)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("--config", default=None, help="TOML settings file (see rebar.toml)")
    serve.add_argument("--model", default=None, help="chat model: alias, .gguf file or HF folder ('none' disables)")
    serve.add_argument("--embedding-model", default=None, help="embedding model ('none' disables)")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--device", default=None)
    serve.add_argument("--quantized-gguf", action="store_true", help="run GGUF weights on the int4/int8 kernels")
    serve.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                       help="how the KV cache stores keys and values (auto: the model's dtype)")
    serve.set_defaults(handler=cmd_serve)

    inspect = commands.add_parser("inspect", help="show a model's architecture, tensors, tokenizer, template")
    inspect.add_argument("model")
    inspect.add_argument("--tensors", action="store_true", help="list every tensor")
    inspect.add_argument("--full-template", action="store_true")
    inspect.set_defaults(handler=cmd_inspect)

    add_quantize_parser(commands)
    add_eval_parser(commands, _add_model_args)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    offline = bench.add_parser("offline", help="engine throughput and latency at a fixed concurrency")
    _add_model_args(offline)
    offline.add_argument("--num-prompts", type=int, default=16)
    offline.add_argument("--input-len", type=int, default=128)
    offline.add_argument("--output-len", type=int, default=64)
    offline.add_argument("--concurrency", type=int, default=1)
    offline.add_argument("--max-num-batched-tokens", type=int, default=2048)
    offline.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                         help="KV cache storage (auto: the model's dtype)")
    offline.add_argument("--seed", type=int, default=0)
    offline.add_argument("--no-warmup", dest="warmup", action="store_false")
    offline.add_argument("--json", default=None, help="also write the result as JSON to this file")
    offline.set_defaults(handler=cmd_bench_offline)

    serve = bench.add_parser("serve", help="streaming latency and throughput of any OpenAI-compatible server")
    serve.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="model name to request (default: the first from /v1/models)")
    serve.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    serve.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels, run in order")
    serve.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency level")
    serve.add_argument("--input-words", type=int, default=128, help="words per prompt")
    serve.add_argument("--output-tokens", type=int, default=128, help="max_tokens of every request")
    serve.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (an extension vLLM and llama.cpp accept)")
    serve.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    serve.add_argument("--seed", type=int, default=0, help="seed of the prompt generator")
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds before one request counts as failed")
    serve.add_argument("--json", default=None, help="also write the results (one object per level) to this file")
    serve.set_defaults(handler=cmd_bench_serve)
    profile = commands.add_parser("profile", help="profile engine steps: Chrome trace with a range per layer, top operators")
    _add_model_args(profile)
    profile.add_argument("--steps", type=_positive_int, default=8, help="steps to profile (the first is the prefill)")
    profile.add_argument("--batch", type=_positive_int, default=1, help="concurrent requests")
    profile.add_argument("--input-len", type=_positive_int, default=128, help="prompt tokens per request")
    profile.add_argument("--warmup-steps", type=int, default=0, help="steps run before profiling starts")
    profile.add_argument("--top", type=_positive_int, default=20, help="operators in the table")
    profile.add_argument("--output", default="rebar-trace.json", help="where the Chrome trace goes")
    profile.set_defaults(handler=cmd_profile)

    compare = bench.add_parser("compare", help="rebar vs llama.cpp on the same GGUF, threads and prompts; ratios")
    compare.add_argument("--model", default="smollm2", help="a GGUF model (alias or path)")
    compare.add_argument("--threads", type=_positive_int, default=2)
    compare.add_argument("--output-len", type=_positive_int, default=128, help="tokens per decode run")
    compare.add_argument("--repeats", type=_positive_int, default=3, help="runs per figure (the median is reported)")
    compare.add_argument("--no-http", action="store_true", help="skip the 16-stream HTTP figure")
    compare.add_argument("--kv-cache-dtype", default="float16", choices=KV_CACHE_DTYPES,
                         help="rebar's KV cache storage (default float16, as llama.cpp's default f16 cache)")
    compare.add_argument("--seed", type=int, default=0)
    compare.add_argument("--json", default=None, help="also write the report as JSON to this file")
    compare.set_defaults(handler=cmd_bench_compare)

    gate = bench.add_parser("gate", help="CI performance gate: cold start, p95 latency, peak RSS against a baseline")
    gate.add_argument("--model", default="smollm2")
    gate.add_argument("--baseline", default="perf/baseline.json", help="committed baseline (normalised figures)")
    gate.add_argument("--update-baseline", action="store_true", help="measure and write the baseline instead of judging")
    gate.add_argument("--threads", type=int, default=1,
                      help="torch threads (1: immune to the barrier stalls a busy machine causes; must match the baseline)")
    gate.set_defaults(handler=cmd_bench_gate)

    config_commands = commands.add_parser("config", help="settings").add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the effective settings (defaults < --config file < REBAR_* env); keys masked")
    show.add_argument("--config", type=Path, default=None, help="TOML settings file")
    show.add_argument("--format", default="toml", choices=["toml", "json"])
    show.set_defaults(handler=cmd_config_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.handler(args)
    except RebarError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
