"""Record how llama.cpp's own `llama-server` renders and tokenizes chats for a GGUF file, as a test
fixture (dev tool): the benchmarks send both servers the same chat requests, so both must turn them
into the same prompt.

The server starts as the benchmarks start it (`rebar_bench.llamacpp.LlamaServer`, whose template
options come from `chat_template_args`); each conversation is rendered and tokenized as its chat
completions do (`rebar_bench.llamacpp.rendered_chat`).

    PYTHONPATH=src python scripts/make_llamacpp_template_fixtures.py --model gemma3 \
        --out tests/fixtures/gemma3_llamacpp_chat_template.json

Output: {"generator", "model_file", "llama_cpp_version", "server_args", "cases": [{"messages",
"prompt", "ids"}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from rebar.model.resolve import resolve_model_path
from rebar_bench.llamacpp import LlamaServer, chat_template_args, find_tool, rendered_chat
from rebar_bench.rebar_server import free_port
from rebar_bench.spec_prompts import CHAT, GROUNDED

CONVERSATIONS = [
    *([{"role": "user", "content": request.message}] for request in (*GROUNDED, *CHAT)),
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sea salty?"},
    ],
    [
        {"role": "user", "content": "  Name a colour.  \n"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3", help="alias or .gguf path")
    parser.add_argument("--out", required=True)
    parser.add_argument("--llama-server", default=None)
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    tool = find_tool("llama-server", args.llama_server)
    version = subprocess.run([str(tool), "--version"], capture_output=True, text=True)
    cases = []
    with LlamaServer(tool, path, threads=2, port=free_port(), parallel=1) as server:
        for messages in CONVERSATIONS:
            prompt, ids = rendered_chat(server.url, messages)
            cases.append({"messages": messages, "prompt": prompt, "ids": ids})
    lines = version.stderr.strip().splitlines()
    out = {
        "generator": "scripts/make_llamacpp_template_fixtures.py",
        "model_file": path.name,
        "llama_cpp_version": lines[0] if lines else "",
        "server_args": chat_template_args(path),
        "cases": cases,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
