"""API-key authentication: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`)
checked against SHA-256 digests.

The checker never holds a key in plain text, only digests, and compares a presented key with
every stored digest in constant time, so neither timing nor an early exit reveals which key (or
how much of one) matched.
"""

from __future__ import annotations

import hmac
import re

from rebar.config import Settings, hash_api_key

_DIGEST = re.compile(r"[0-9a-f]{64}")


def hash_key(key: str) -> str:
    """SHA-256 hex digest of `key`: the same digest `Settings.api_key_hashes()` produces."""
    return hash_api_key(key)


def bearer_token(authorization_header: str | None) -> str | None:
    """The token of `Bearer <token>` (scheme case-insensitive), or None if absent or malformed."""
    if authorization_header is None:
        return None
    scheme, _, token = authorization_header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or any(char.isspace() for char in token):
        return None
    return token


class ApiKeyChecker:
    """Decides whether a request's Authorization header carries a configured key.

    `enabled` is False when no digests were given; then `check` accepts every request. Callers
    may rely on `check` never raising, whatever the header holds.
    """

    __slots__ = ("_digests",)

    def __init__(self, hashes: frozenset[str]) -> None:
        digests = [digest.lower() for digest in hashes]
        if not all(_DIGEST.fullmatch(digest) for digest in digests):
            # Guards against passing keys where digests belong; the message does not echo them.
            raise ValueError("ApiKeyChecker takes SHA-256 hex digests (see hash_key), not keys")
        self._digests: tuple[bytes, ...] = tuple(
            sorted(digest.encode("ascii") for digest in digests)
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeyChecker:
        """A checker for `settings.api_key_hashes()` (reads the key file; may raise ConfigError)."""
        return cls(settings.api_key_hashes())

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def num_keys(self) -> int:
        return len(self._digests)

    def check(self, authorization_header: str | None) -> bool:
        """True when auth is off, or the header is `Bearer <key>` for a configured key."""
        return not self._digests or self.matching_digest(authorization_header) is not None

    def matching_digest(self, authorization_header: str | None) -> str | None:
        """The SHA-256 digest of the configured key the header carries, or None (always None when
        auth is off)."""
        return self.key_digest(bearer_token(authorization_header))

    def key_digest(self, key: str | None) -> str | None:
        """The SHA-256 digest of `key` when it is a configured key, else None (as sent in
        Anthropic's `x-api-key` header, with no scheme)."""
        if key is None or not key.strip() or not self._digests:
            return None
        presented = hash_key(key.strip()).encode("ascii")
        matched = False
        for digest in self._digests:  # every digest, no early exit
            matched |= hmac.compare_digest(presented, digest)
        return presented.decode("ascii") if matched else None
