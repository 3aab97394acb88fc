"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest

from rebar.engine.spec.policy import Acceptance


@pytest.fixture
def eager_drafts(monkeypatch):
    """Every sequence drafts all it may in every step, whatever its record: the tests' random
    models rarely repeat what a drafter guesses, and a sequence whose drafts fail stops drafting
    (rebar.engine.spec.policy), so the paths that check drafts would soon stop running."""
    monkeypatch.setattr(Acceptance, "rate", lambda self, prior: 0.9)
