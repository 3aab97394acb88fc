"""The `rebar` command: generate, chat, serve, inspect, quantize, eval, bench, profile, config,
summarize, desktop."""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from rebar.config.flags import (
    add_config_flag,
    add_setting_flags,
    as_overrides,
    given_settings,
    settings_from_flags,
)
from rebar.contract_cli import add_contract_parser
from rebar.desktop.cli import add_desktop_parser
from rebar.documents.cli import add_summarize_parser
from rebar.errors import ConfigError, InvalidRequestError, RebarError
from rebar.eval.cli import add_eval_parser
from rebar.models_cli import add_models_parser
from rebar.openmp_env import shorten_openmp_spin
from rebar.quant.cli import add_quantize_parser


def add_model_args(parser: argparse.ArgumentParser, skip: Collection[str] = ()) -> None:
    """`--model`, `--config` and a flag for each [models] loading setting and [engine] setting
    (except those in `skip`, which the command sets itself): what every command that loads a
    model takes, read by `LLM.from_settings(args.model, settings_from_flags(args))`."""
    parser.add_argument(
        "--model",
        default="smollm2",
        help="alias (smollm2, minilm, gemma3), a .gguf file or an HF folder",
    )
    add_config_flag(parser)
    add_setting_flags(parser, "models", only=("dtype", "device", "dequantize"))
    add_setting_flags(parser, "engine", skip={"separate_process", *skip})


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


def _load(args: argparse.Namespace, **fixed: object):
    from rebar.llm import LLM

    return LLM.from_settings(args.model, settings_from_flags(args, **fixed))


def _stream_to_stdout(llm, prompt: str | list[int], params) -> str:
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
    print(
        f"rebar chat — {args.model} loaded in {llm.load_seconds:.1f}s. "
        "/reset clears, /exit or Ctrl-D quits.",
        file=sys.stderr,
    )
    messages: list[dict[str, str]] = (
        [{"role": "system", "content": args.system}] if args.system else []
    )
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
            answer = _stream_to_stdout(llm, llm.chat_prompt_ids(messages), params)
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

    settings = load_settings(args.config, serve_overrides(args), "from the command line")
    configure_logging(settings.logging.level, settings.logging.format)
    if args.ray:
        try:
            from rebar.ray_serve import run
        except ImportError as exc:
            raise ConfigError(
                f"rebar serve --ray needs Ray Serve: pip install 'rebar[ray]' ({exc})"
            ) from None
        run(settings)
        return 0
    run_server(create_app(settings), settings.server, settings.logging.level)
    return 0


def serve_overrides(args: argparse.Namespace) -> dict[str, object]:
    """`rebar serve`'s flags as settings overrides; a flag not given is None (overrides nothing)."""
    return {
        "models.chat": args.model,
        "models.embedding": args.embedding_model,
        **as_overrides(given_settings(args)),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    from rebar.model.describe import family_lines
    from rebar.model.loader import open_checkpoint

    checkpoint = open_checkpoint(args.model)
    config = checkpoint.config
    print(f"path:          {checkpoint.path}")
    print(f"format:        {checkpoint.format}")
    print(f"architecture:  {config.source_architecture} (runs as {config.architecture})")
    if config.name:
        print(f"name:          {config.name}")
    family = family_lines(config)
    if family:
        print("family:")
        for line in family:
            print(f"  {line}")
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
    print(
        f"tensors:       {len(checkpoint.tensors)}, {num_params / 1e6:.1f}M "
        f"parameters, {num_bytes / 2**20:.1f} MiB stored"
    )
    print(
        "storage types: " + ", ".join(f"{kind} x{count}" for kind, count in storage.most_common())
    )
    if args.tensors:
        for info in infos:
            print(f"  {info.file_name:48s} {list(info.shape)!s:18s} {info.storage}")
    tokenizer = checkpoint.tokenizer
    special = tokenizer.special
    print(
        f"tokenizer:     {tokenizer.kind}, vocab {tokenizer.vocab_size}, bos {special.bos_token!r} "
        f"(add_bos={special.add_bos}), eos "
        f"{[tokenizer.id_to_token(i) for i in special.eos_token_ids]}"
    )
    template = checkpoint.chat_template
    if template is None:
        print("chat template: none")
    else:
        shown = template if args.full_template or len(template) <= 400 else template[:400] + " ..."
        print(f"chat template ({len(template)} chars):\n{shown}")
    return 0


_ENCODER_FIELDS = {"type_vocab_size", "pooling", "normalize_embeddings", "max_seq_length"}
_DECODER_FIELDS = {
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "tie_word_embeddings",
    "sliding_window",
}


def cmd_profile(args: argparse.Namespace) -> int:
    import json

    from rebar.engine.profile_run import profile_engine
    from rebar.llm import LLM

    fixed: dict[str, object] = {"engine.max_num_seqs": args.batch}
    settings = settings_from_flags(args, **fixed)
    if "engine.max_num_batched_tokens" not in given_settings(args):
        # the whole batch's prompts fit in the first (profiled) step
        most = max(settings.engine.max_num_batched_tokens, args.batch * args.input_len)
        settings = settings_from_flags(args, **fixed, **{"engine.max_num_batched_tokens": most})
    llm = LLM.from_settings(args.model, settings)
    if llm.engine is None:
        raise InvalidRequestError(
            f"{args.model} is an embedding model; profile needs a generator", "model"
        )
    result = profile_engine(
        llm.engine, args.steps, args.batch, args.input_len, args.warmup_steps, args.top
    )
    with open(args.output, "w", encoding="utf-8") as out:
        json.dump(result.trace, out)
    print(result.table)
    print(
        f"{result.num_steps} steps in {result.seconds:.3f}s; Chrome trace written to {args.output} "
        "(open in ui.perfetto.dev or chrome://tracing)"
    )
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
        print(
            f"# auth: on, {num_keys} distinct key(s)"
            if num_keys
            else "# auth: off (no api_keys or api_key_file)"
        )
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
    parser = argparse.ArgumentParser(
        prog="rebar", description="rebar: LLM inference from first principles"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generation_parsers(commands)
    _add_serve_parser(commands)
    _add_inspect_parser(commands)
    add_quantize_parser(commands)
    add_eval_parser(commands, add_model_args)
    _add_plugin_parsers(commands)
    _add_profile_parser(commands)
    _add_config_parser(commands)
    add_contract_parser(commands, add_model_args)
    add_models_parser(commands)
    add_summarize_parser(commands, add_model_args)
    add_desktop_parser(commands)
    return parser


# Entry points that add subcommands (e.g. `bench`, from rebar_bench).
PLUGIN_GROUP = "rebar.commands"


def _add_plugin_parsers(commands: Any) -> None:
    """Subcommands of installed tooling packages, found by entry point: the service never imports
    them by name. Each entry point is `add_parser(commands, add_model_args, positive_int)`."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        entry.load()(commands, add_model_args, _positive_int)


def _add_generation_parsers(commands: Any) -> None:
    """`generate` and `chat`: a model, sampling and engine flags."""
    generate = commands.add_parser("generate", help="complete a prompt, streaming tokens to stdout")
    add_model_args(generate)
    _add_sampling_args(generate, max_tokens=128)
    generate.add_argument("prompt")
    generate.set_defaults(handler=cmd_generate)

    chat = commands.add_parser("chat", help="interactive chat using the model's chat template")
    add_model_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="system prompt (default: the template's own)")
    chat.set_defaults(handler=cmd_chat)


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_config_flag(serve)
    serve.add_argument(
        "--ray",
        action="store_true",
        help="run as a Ray Serve deployment: [ray] replicas behind Ray Serve's HTTP proxy",
    )
    serve.add_argument(
        "--model",
        default=None,
        help="models.chat: alias, .gguf file or HF folder ('none' disables)",
    )
    serve.add_argument("--embedding-model", default=None, help="models.embedding ('none' disables)")
    add_setting_flags(serve, "server", only=("host", "port"))
    add_setting_flags(serve, "models", only=("dtype", "device", "dequantize"))
    add_setting_flags(serve, "engine")
    serve.set_defaults(handler=cmd_serve)


def _add_inspect_parser(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect", help="show a model's architecture, tensors, tokenizer, template"
    )
    inspect.add_argument("model")
    inspect.add_argument("--tensors", action="store_true", help="list every tensor")
    inspect.add_argument("--full-template", action="store_true")
    inspect.set_defaults(handler=cmd_inspect)


def _add_profile_parser(commands: Any) -> None:
    profile = commands.add_parser(
        "profile", help="profile engine steps: Chrome trace with a range per layer, top operators"
    )
    add_model_args(profile, skip={"max_num_seqs"})  # --batch sets it
    profile.add_argument(
        "--steps", type=_positive_int, default=8, help="steps to profile (the first is the prefill)"
    )
    profile.add_argument("--batch", type=_positive_int, default=1, help="concurrent requests")
    profile.add_argument(
        "--input-len", type=_positive_int, default=128, help="prompt tokens per request"
    )
    profile.add_argument(
        "--warmup-steps", type=int, default=0, help="steps run before profiling starts"
    )
    profile.add_argument("--top", type=_positive_int, default=20, help="operators in the table")
    profile.add_argument("--output", default="rebar-trace.json", help="where the Chrome trace goes")
    profile.set_defaults(handler=cmd_profile)


def _add_config_parser(commands: Any) -> None:
    config_commands = commands.add_parser("config", help="settings").add_subparsers(
        dest="config_command", required=True
    )
    show = config_commands.add_parser(
        "show",
        help="print the effective settings (defaults < --config file < REBAR_* env); keys masked",
    )
    show.add_argument("--config", type=Path, default=None, help="TOML settings file")
    show.add_argument("--format", default="toml", choices=["toml", "json"])
    show.set_defaults(handler=cmd_config_show)


def main(argv: Sequence[str] | None = None) -> int:
    shorten_openmp_spin()  # before any command imports torch (libgomp reads it once, on load)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.handler(args)
    except RebarError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
