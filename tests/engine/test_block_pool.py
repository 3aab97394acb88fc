"""Block pool and KV cache manager: reference counts, LRU reuse, prefix hits verified by tokens."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from rebar import SamplingParams
from rebar.engine.block_pool import BlockPool, chain_hash, salt_hash
from rebar.engine.kv_cache_manager import KVCacheManager
from rebar.engine.request import Request


def make_request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=4),
        max_total_tokens=len(tokens) + 4,
        cache_salt=cache_salt,
    )


def test_allocate_and_free_round_trip() -> None:
    pool = BlockPool(4)
    taken = pool.allocate(3)
    assert pool.num_free_blocks == 1 and all(pool.blocks[b].ref_count == 1 for b in taken)
    pool.free(taken)
    assert pool.num_free_blocks == 4
    pool.check_integrity({})


def test_never_used_blocks_go_first_in_id_order_and_are_made_only_when_handed_out() -> None:
    """A pool of a million blocks holds none until asked; blocks never handed out come before
    freed ones (which keep their cached prefixes longest), lowest id first."""
    pool = BlockPool(1_000_000)
    assert pool.num_free_blocks == 1_000_000 and pool.usage == 0.0
    first = pool.allocate(2)
    assert first == [0, 1] and len(pool.blocks) == 2
    pool.register(first[0], chain_hash(None, [1, 2]), [1, 2])
    pool.free(first)
    assert pool.allocate(3) == [2, 3, 4]  # not the freed 0 and 1
    assert pool.lookup(chain_hash(None, [1, 2]), [1, 2]) == 0  # its prefix is still cached
    assert pool.num_free_blocks == 1_000_000 - 3
    pool.check_integrity({2: 1, 3: 1, 4: 1})
    with pytest.raises(RuntimeError, match="asked for 999998 blocks, 999997 free"):
        pool.allocate(999_998)


def test_a_small_pool_hands_out_freed_blocks_once_every_block_was_used() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, chain_hash(None, [7]), [7])
    pool.free([a])
    assert pool.allocate(1) == [a]  # the only free block: its cached prefix is evicted
    assert pool.lookup(chain_hash(None, [7]), [7]) is None
    pool.check_integrity({a: 1, b: 1})


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.allocate(3) == [b, a, c]


def test_reusing_a_cached_block_evicts_its_prefix() -> None:
    pool = BlockPool(1)
    (block,) = pool.allocate(1)
    pool.register(block, chain_hash(None, [1, 2]), [1, 2])
    pool.free([block])
    assert pool.lookup(chain_hash(None, [1, 2]), [1, 2]) == block
    pool.allocate(1)
    assert pool.lookup(chain_hash(None, [1, 2]), [1, 2]) is None


def test_hash_hit_with_different_tokens_is_rejected() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    fake_hash = b"\x01" * 32
    pool.register(block, fake_hash, [1, 2])
    assert pool.lookup(fake_hash, [9, 9]) is None  # a collision never serves the wrong KV
    assert pool.lookup(fake_hash, [1, 2]) == block


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError):
        pool.free([block])


def test_second_request_with_same_prefix_shares_full_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(10)))
    assert manager.allocate(first, 10)
    first.num_computed_tokens = 10
    second = make_request("b", [*list(range(10)), 99])
    prefix = manager.find_cached_prefix(second)
    assert (
        prefix == manager.block_ids("a")[:2]
    )  # two full blocks of 4; the partial third is not shared
    assert manager.allocate(second, 11 - 8, prefix)
    assert manager.block_ids("b")[:2] == prefix
    assert all(manager.pool.blocks[b].ref_count == 2 for b in prefix)
    manager.check_integrity()
    manager.free(first)
    manager.free(second)
    manager.check_integrity()
    assert manager.pool.num_free_blocks == 8


def test_prefix_hit_always_leaves_a_token_to_compute() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(8)))
    assert manager.allocate(first, 8)
    again = make_request("b", list(range(8)))
    assert len(manager.find_cached_prefix(again)) == 1  # 8 tokens cached, but the last must run


def test_allocation_failure_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert not manager.allocate(request, 12)
    assert manager.pool.num_free_blocks == 2 and manager.block_ids("a") == []
    manager.check_integrity()


def test_free_cached_prefix_blocks_count_against_the_free_pool() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=4)
    first = make_request("a", list(range(8)))
    assert manager.allocate(first, 8)
    manager.free(first)  # both blocks free but cached
    second = make_request("b", [*list(range(8)), 50, 51, 52, 53, 54])
    prefix = manager.find_cached_prefix(second)
    assert len(prefix) == 2
    # 13 tokens need 4 blocks: 2 shared + 2 new, but only 1 block is free besides the prefix.
    assert not manager.allocate(second, 13 - 8, prefix)
    manager.check_integrity()


def test_failed_step_uncaches_its_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", list(range(8)))
    assert manager.allocate(request, 8)
    manager.free(request, keep_cached=False)
    assert manager.find_cached_prefix(make_request("b", list(range(9)))) == []


def test_block_hashes_are_sha256_of_a_canonical_encoding() -> None:
    first = chain_hash(None, [1, 2])
    assert first == hashlib.sha256(bytes(32) + struct.pack("<2q", 1, 2)).digest()
    assert (
        chain_hash(first, [3, 70000])
        == hashlib.sha256(first + struct.pack("<2q", 3, 70000)).digest()
    )
    assert chain_hash(salt_hash(None), [1, 2]) == first
    assert (
        len(
            {
                first,
                chain_hash(salt_hash("a"), [1, 2]),
                chain_hash(salt_hash("b"), [1, 2]),
                chain_hash(None, [2, 1]),
            }
        )
        == 4
    )


HASH_SCRIPT = """
from rebar.engine.block_pool import chain_hash, salt_hash
print(chain_hash(chain_hash(salt_hash("tenant-\\u00e9"), range(16)), [5] * 16).hex(), chain_hash(None, [1, 2]).hex())
"""


def test_block_hashes_do_not_depend_on_the_process_hash_seed() -> None:
    def digests(seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        return subprocess.run(
            [sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True, text=True, check=True
        ).stdout

    assert digests("1") == digests("2") != ""


def test_only_requests_with_the_same_salt_share_cached_blocks() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(10))
    for request_id, salt in (("owner", "tenant-a"), ("plain", None)):
        request = make_request(request_id, tokens, salt)
        assert manager.find_cached_prefix(request) == [] and manager.allocate(request, 10)
    assert len(manager.find_cached_prefix(make_request("same", tokens, "tenant-a"))) == 2
    assert len(manager.find_cached_prefix(make_request("unsalted", tokens))) == 2
    assert manager.find_cached_prefix(make_request("other", tokens, "tenant-b")) == []
    assert (
        manager.find_cached_prefix(make_request("empty", tokens, "")) == []
    )  # "" is a salt, not None
    manager.check_integrity()
