"""API-key checking: Bearer parsing, digests only, every stored digest compared."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from rebar.config import Settings
from rebar.server.auth import ApiKeyChecker, bearer_token, hash_key

KEYS = ("sk-alpha-1234", "sk-beta-5678", "sk-gamma-9012")


@pytest.fixture
def checker() -> ApiKeyChecker:
    return ApiKeyChecker(frozenset(hash_key(key) for key in KEYS))


def test_hash_key_is_sha256_hex_and_matches_settings() -> None:
    assert hash_key("k1") == hashlib.sha256(b"k1").hexdigest()
    assert Settings(server={"api_keys": ["k1"]}).api_key_hashes() == frozenset({hash_key("k1")})


@pytest.mark.parametrize("key", KEYS)
def test_every_configured_key_passes(checker: ApiKeyChecker, key: str) -> None:
    assert checker.enabled
    assert checker.check(f"Bearer {key}")
    assert checker.check(f"bearer {key}")  # the scheme is case-insensitive
    assert checker.check(f"  Bearer   {key}  ")


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer    ",
        "Bearer sk-wrong",
        f"Bearer {KEYS[0]}x",
        f"Bearer {KEYS[0][:-1]}",
        f"Basic {KEYS[0]}",
        KEYS[0],
        f"Bearer {KEYS[0]} {KEYS[1]}",
        f"Token {KEYS[0]}",
        f"Bearer{KEYS[0]}",
        "Bearer \udcff",
        "Bearer ключ",
        "Bearer \x00",
    ],
)
def test_wrong_missing_or_malformed_headers_fail(
    checker: ApiKeyChecker, header: str | None
) -> None:
    assert checker.check(header) is False


def test_disabled_checker_allows_everything() -> None:
    checker = ApiKeyChecker(frozenset())
    assert not checker.enabled and checker.num_keys == 0
    for header in (None, "", "Bearer anything", "Basic x"):
        assert checker.check(header)


def test_checker_holds_digests_only(checker: ApiKeyChecker) -> None:
    assert not hasattr(checker, "__dict__")
    held = [
        getattr(checker, name)
        for cls in type(checker).__mro__
        for name in getattr(cls, "__slots__", ())
    ]
    text = repr(held)
    for key in KEYS:
        assert key not in text and key.encode() not in text.encode()
        assert hash_key(key) in text
    assert checker.num_keys == len(KEYS)


def test_checker_refuses_plaintext_keys_without_echoing_them() -> None:
    with pytest.raises(ValueError) as caught:
        ApiKeyChecker(frozenset({KEYS[0]}))
    assert KEYS[0] not in str(caught.value)


@pytest.mark.parametrize("header", [f"Bearer {KEYS[0]}", f"Bearer {KEYS[2]}", "Bearer sk-wrong"])
def test_every_digest_is_compared_in_constant_time(
    checker: ApiKeyChecker, header: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    checker.check(header)
    assert len(calls) == len(KEYS)  # no early exit on the first match or mismatch
    assert {b for _, b in calls} == {hash_key(key).encode() for key in KEYS}


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("BEARER abc") == "abc"
    assert bearer_token("Bearer a b") is None
    assert bearer_token(None) is None


def test_from_settings_reads_config_and_key_file(tmp_path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# ops\nfile-key\n", encoding="utf-8")
    checker = ApiKeyChecker.from_settings(
        Settings(server={"api_keys": ["conf-key"], "api_key_file": key_file})
    )
    assert checker.check("Bearer conf-key") and checker.check("Bearer file-key")
    assert not checker.check("Bearer ops")


def test_matching_digest_names_the_key_that_matched(checker: ApiKeyChecker) -> None:
    digest = checker.matching_digest(f"Bearer {KEYS[1]}")
    assert digest == hash_key(KEYS[1])  # the digest rate limits and tenant caches are keyed by
    assert (
        checker.matching_digest("Bearer not-a-key") is None
        and checker.matching_digest(None) is None
    )
    assert (
        ApiKeyChecker(frozenset()).matching_digest(f"Bearer {KEYS[1]}") is None
    )  # auth off: no key identity


def test_a_bare_key_as_anthropic_sends_it_matches_the_same_digest(checker: ApiKeyChecker) -> None:
    assert (
        checker.key_digest(KEYS[2])
        == hash_key(KEYS[2])
        == checker.matching_digest(f"Bearer {KEYS[2]}")
    )
    for wrong in (None, "", "   ", "sk-wrong", f"Bearer {KEYS[2]}", KEYS[2][:-1]):
        assert checker.key_digest(wrong) is None
    assert ApiKeyChecker(frozenset()).key_digest(KEYS[0]) is None  # auth off: no key identity
