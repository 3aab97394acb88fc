"""Assertions shared by tests of many packages."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def raises(error: type[Exception], action: Callable[[], object], *culprits: str) -> str:
    """Run `action`, expect `error`, and check that its message names every culprit; returns the
    message."""
    with pytest.raises(error) as info:
        action()
    message = str(info.value)
    for culprit in culprits:
        assert culprit in message, f"{culprit!r} not in {message!r}"
    return message
