"""`rebar quantize`, `rebar inspect DIR`, `rebar eval ppl` and `rebar serve --model DIR` as a user
runs them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tiny_quant import tiny_gguf

from rebar.quant.quantize import source_digest
from suite_tiers import limit

pytestmark = limit("processes")  # tests/suite_tiers.py


def rebar(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rebar.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("cli"))[0]


@pytest.fixture(scope="module")
def quantized(
    source: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("cli-out") / "int4"
    return out, rebar(
        "quantize", str(source), "--method", "int4-rtn", "--group-size", "32", "--out", str(out)
    )


def test_quantize_writes_a_checkpoint_with_a_progress_bar(quantized) -> None:
    out, result = quantized
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out} (int4-rtn, ")
    assert "quantizing: 100%" in result.stderr
    assert {p.name for p in out.iterdir()} == {
        "rebar-quant.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_inspect_shows_method_group_size_sizes_and_source(quantized, source: Path) -> None:
    out, _ = quantized
    result = rebar("inspect", str(out))
    assert result.returncode == 0, result.stderr
    for expected in (
        "format:        rebar-quant",
        "quant.method: int4-rtn",
        "quant.group_size: 32",
        f"quant.source.sha256: {source_digest(source)}",
        "storage types: int4 g32 x14",
        "int8 per-channel x2",
        "MiB stored",
    ):
        assert expected in result.stdout


def test_eval_ppl_prints_perplexity_tokens_and_time(quantized, tmp_path: Path) -> None:
    out, _ = quantized
    data = tmp_path / "eval.jsonl"
    data.write_text(
        "".join(json.dumps({"body": f"the and then {i} in an"}) + "\n" for i in range(20)),
        encoding="utf-8",
    )
    result = rebar(
        "eval",
        "ppl",
        "--model",
        str(out),
        "--data",
        str(data),
        "--text-field",
        "body",
        "--context",
        "32",
        "--stride",
        "16",
        "--max-tokens",
        "100",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("perplexity: ") and float(lines[0].split()[1]) > 1
    assert lines[1].startswith("tokens:     99 scored in 6 windows (context 32, stride 16)")
    assert lines[2].startswith("time:       ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["quantize", "{source}", "--method", "int8", "--calib", "c.jsonl", "--out", "{tmp}/x"],
            "--calib only applies to int4-awq",
        ),
        (
            [
                "quantize",
                "{source}",
                "--method",
                "int4-rtn",
                "--group-size",
                "128",
                "--out",
                "{tmp}/x",
            ],
            "group size 128 does not divide layers.0.attn.q_proj",
        ),
        (
            ["quantize", "{source}", "--method", "int4-awq", "--out", "{tmp}/x"],
            "int4-awq needs calibration text",
        ),
        (
            [
                "eval",
                "ppl",
                "--model",
                "{source}",
                "--data",
                "{tmp}/none.txt",
                "--context",
                "16",
                "--stride",
                "16",
            ],
            "stride must be at least 1 and less than the context",
        ),
        (["eval", "ppl", "--model", "{source}", "--data", "{tmp}/none.txt"], "does not exist"),
    ],
    ids=["calib-with-int8", "group-size", "awq-without-calib", "stride", "missing-data"],
)
def test_mistakes_are_clean_errors(
    source: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    result = rebar(*[a.format(source=source, tmp=tmp_path) for a in args])
    assert result.returncode == 2
    assert (
        result.stderr.startswith("error: ")
        and message in result.stderr
        and "Traceback" not in result.stderr
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_from_a_quantized_checkpoint(quantized, tmp_path: Path) -> None:
    out, _ = quantized
    port = free_port()
    env = {**os.environ, "REBAR_ENGINE__KV_CACHE_MEMORY": str(16 * 2**20)}
    with open(tmp_path / "server.log", "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebar.cli",
                "serve",
                "--model",
                str(out),
                "--embedding-model",
                "none",
                "--port",
                str(port),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(
                "server never became ready:\n" + (tmp_path / "server.log").read_text()
            )
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": "the and",
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5
    finally:
        process.terminate()
        process.wait(timeout=30)
