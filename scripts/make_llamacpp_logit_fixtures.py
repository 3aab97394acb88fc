"""Record llama.cpp's next-token predictions at every position of fixed token ids, as a test
fixture (dev tool): teacher-forced, the top 5 tokens and their log-probabilities after each prefix.

Starts llama.cpp's own `llama-server` (a native build, found as `rebar bench compare` finds it) on a
GGUF file and asks its `/completion` endpoint, for each prefix of each text, for one token with
the 5 most probable ones before any sampler (`n_probs`, `post_sampling_probs` off; log-probabilities
differ from logits by one constant per position, so their gaps are the logits' gaps). Each prefix
is evaluated afresh, each text on a server of its own (llama-server stalled now and then here
after many requests; a stalled text is retried on a fresh one). Texts are
chat turns (question and answer, the answer teacher-forced) and plain text, tokenized by llama.cpp
itself, the file's BOS token first where it asks for one.

    PYTHONPATH=src python scripts/make_llamacpp_logit_fixtures.py --model gemma3 \
        --chat-template '<start_of_turn>user\\n{}<end_of_turn>\\n<start_of_turn>model\\n{}' \
        --out tests/fixtures/gemma3_llamacpp_logits.json

Output: {"generator", "model_file", "model_sha256", "llama_cpp_version", "cases": [{"text", "ids",
"top5_ids": [[int] * 5 per position], "top5_logprobs": [[float] * 5 per position]}, ...]}; position
i describes the token after ids[: i + 1].
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

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n{}"
# (question, answer): the answer is teacher-forced, so its positions test the model mid-reply.
TURNS = [
    (
        "What is the boiling point of water?",
        "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is "
        "lower, so it boils at a lower temperature.",
    ),
    (
        "Give me a word that rhymes with cat.",
        "Hat rhymes with cat, and so do bat, mat and sat. Would you like a short poem with them?",
    ),
    (
        "Who wrote Romeo and Juliet?",
        "William Shakespeare wrote Romeo and Juliet, a tragedy first performed in the 1590s about "
        "two young lovers from feuding families in Verona.",
    ),
    (
        "List two planets.",
        "Mars and Jupiter are two planets in our solar system. Mars is rocky and red, while "
        "Jupiter is a gas giant.",
    ),
    (
        "How do I make a cup of tea?",
        "Boil water, put a tea bag in a cup, pour the hot water over it and let it steep for three "
        "to five minutes. Remove the bag and add milk or sugar if you like.",
    ),
    (
        "Summarise: The river flooded the village after a week of heavy rain.",
        "After a week of heavy rain, the river overflowed and flooded the village.",
    ),
]
PLAIN = [
    "The museum opened its doors in 1902, and since then it has collected paintings, maps and "
    "letters from every corner of the country. Its newest wing holds",
    "import os\n\n\ndef list_files(folder):\n    return sorted(os.listdir(folder))\n\n\n"
    "def count_files(folder):\n    return len(list_files(folder))\n",
    "In the morning the market fills with farmers selling bread, cheese and fresh vegetables, "
    "and by noon most of the stalls are",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, which contain",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March,",
    "The train left the station at seven o'clock. By the time it reached the coast, the sun had",
]
TOP = 5


def predictions(tool: Path, path: Path, text: str) -> dict:
    """llama.cpp's top 5 after every prefix of `text`, from a server of its own."""
    with LlamaServer(tool, path, threads=2, port=free_port(), parallel=1) as server:
        ids = httpx.post(
            server.url + "/tokenize",
            json={"content": text, "add_special": True, "parse_special": True},
            timeout=60,
        ).json()["tokens"]
        top_ids, top_logprobs = [], []
        for end in range(1, len(ids) + 1):
            reply = httpx.post(
                server.url + "/completion",
                timeout=30,
                json={
                    "prompt": ids[:end],
                    "n_predict": 1,
                    "n_probs": TOP,
                    "post_sampling_probs": False,
                    "temperature": 0.0,
                    "cache_prompt": False,
                },
            ).json()
            ranked = reply["completion_probabilities"][0]["top_logprobs"]
            top_ids.append([entry["id"] for entry in ranked])
            top_logprobs.append([round(entry["logprob"], 4) for entry in ranked])
    return {"text": text, "ids": ids, "top5_ids": top_ids, "top5_logprobs": top_logprobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="alias or .gguf path")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--chat-template", default=CHAT, help="format string a question and its answer go into"
    )
    parser.add_argument("--llama-server", default=None)
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    tool = find_tool("llama-server", args.llama_server)
    version = subprocess.run([str(tool), "--version"], capture_output=True, text=True).stderr
    texts = [args.chat_template.format(q, a) for q, a in TURNS] + PLAIN
    cases = []
    for text in texts:
        for attempt in range(3):
            try:
                cases.append(predictions(tool, path, text))
                break
            except httpx.ReadTimeout:  # a stalled server: start a fresh one for the text
                print(f"llama-server stalled (attempt {attempt + 1}): {text[:40]!r}", flush=True)
        else:
            raise SystemExit(f"llama-server stalled three times on {text[:40]!r}")
        print(f"{len(cases[-1]['ids'])} positions: {text[:40]!r}", flush=True)
    out = {
        "generator": "scripts/make_llamacpp_logit_fixtures.py",
        "model_file": path.name,
        "model_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "llama_cpp_version": version.strip().splitlines()[0] if version.strip() else "",
        "cases": cases,
    }
    Path(args.out).write_text(json.dumps(out) + "\n", encoding="utf-8")
    print(
        f"wrote {sum(len(c['ids']) for c in cases)} positions of {len(cases)} texts to {args.out}"
    )


if __name__ == "__main__":
    main()
