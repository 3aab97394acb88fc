"""Quantization tests reuse the tiny-model builders that live beside the model tests."""

from __future__ import annotations

import sys
from pathlib import Path

MODEL_TEST_HELPERS = str(Path(__file__).resolve().parent.parent / "model")
if MODEL_TEST_HELPERS not in sys.path:
    sys.path.append(MODEL_TEST_HELPERS)
