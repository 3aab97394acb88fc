"""The pool of fixed-size KV blocks: reference counts, an LRU free list, and the prefix-cache index.

Pure Python bookkeeping; the KV tensors themselves live in `rebar.kernels.attention.KVCache`.
A block is *free* when no request holds it (ref_count == 0). A free block may still hold a cached
prefix (it keeps its hash) until it is reused: free blocks are handed out least recently freed
first, so recently used prefixes survive longest.

Block hashes are SHA-256 digests chained from a per-request salt: nobody can craft a prompt whose
blocks collide with another request's prefix (Python's `hash()` would allow that), they do not
depend on PYTHONHASHSEED, and requests with different salts never share a block.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_UNSALTED = bytes(32)  # the parent of an unsalted request's first block


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens it holds, to verify a hash hit


def salt_hash(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: only requests with equal salts (or both None)
    share blocks."""
    if cache_salt is None:
        return _UNSALTED
    return hashlib.sha256(
        b"rebar prefix-cache salt\0" + cache_salt.encode("utf-8", "surrogatepass")
    ).digest()


def chain_hash(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block given the hash of the block before it: equal hashes mean equal prefixes.

    SHA-256 of the parent's 32 bytes followed by each token id as 8 little-endian bytes; a parent of
    None means the first block of an unsalted request.
    """
    parent = _UNSALTED if parent_hash is None else parent_hash
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class BlockPool:
    """Blocks are made the first time they are handed out, lowest id first, before any block that
    was freed: a small model's KV budget can be hundreds of thousands of blocks, and making them
    all up front took ~1 s (524,288 blocks). `blocks` holds the ones made so far; the rest are free
    and hold nothing."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self._num_blocks = num_blocks
        self.blocks: list[KVBlock] = []  # block i is blocks[i], for every i handed out so far
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict()  # made blocks now free, LRU first
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_prefix_queries = 0  # full blocks looked up
        self.num_prefix_hits = 0  # ... and found

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self._num_blocks - len(self.blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (evicting whatever prefix they cached), each with
        ref_count 1."""
        if count > self.num_free_blocks:
            raise RuntimeError(
                f"asked for {count} blocks, {self.num_free_blocks} free"
            )  # callers check first
        taken = []
        for _ in range(count):
            block = self._take()
            block.ref_count = 1
            taken.append(block.block_id)
        return taken

    def _take(self) -> KVBlock:
        """A free block holding no cached prefix: a never-used one while any is left, else the
        least recently freed (its prefix evicted)."""
        if len(self.blocks) < self._num_blocks:
            block = KVBlock(len(self.blocks))
            self.blocks.append(block)
            return block
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        return block

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced blocks join the end of the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens after this prefix, or None."""
        self.num_prefix_queries += 1
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        self.num_prefix_hits += 1
        return block_id

    def share(self, block_ids: Iterable[int]) -> None:
        """Take a reference to cached blocks (a prefix hit); free ones leave the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def register(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Publish a full block in the prefix cache (first writer wins on duplicates)."""
        if not self.enable_prefix_caching or block_hash in self._cached:
            return
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block_id

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Forget cached prefixes held in these blocks (their KV may never have been written)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash, block.token_ids = None, ()

    def count_free_among(self, block_ids: Iterable[int]) -> int:
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def check_integrity(self, held: dict[int, int]) -> None:
        """Assert the pool agrees with `held` (block id -> number of requests holding it)."""
        assert all(block_id < len(self.blocks) for block_id in held), "a held block never made"
        for block in self.blocks:
            expected = held.get(block.block_id, 0)
            assert block.ref_count == expected, (
                f"block {block.block_id}: ref_count {block.ref_count}, held {expected}"
            )
            assert (block.block_id in self._free) == (expected == 0), (
                f"block {block.block_id} free-list mismatch"
            )
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, (
                f"cache index points at stale block {block_id}"
            )
        assert len(self._free) == sum(1 for b in self.blocks if b.ref_count == 0)
