"""Which KV blocks each request holds: allocation, prefix-cache hits, release.

The manager maps a request's token positions to blocks (`block_ids[i // block_size]`) and
publishes its full blocks under their chained hashes so later requests with the same tokens and the
same cache salt can share them. Each request's block hashes are computed once and kept on the
request, across preemptions too.
"""

from __future__ import annotations

from collections import Counter

from rebar.engine.block_pool import BlockPool, chain_hash, salt_hash
from rebar.engine.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of the request already published

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks that hold a prefix of the request's tokens (not yet referenced).

        At least one token is always left to compute, since the model must run to sample.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        found: list[int] = []
        hashes = self._block_hashes(request, max_blocks)
        for index in range(max_blocks):
            block_id = self.pool.lookup(hashes[index], self._block_tokens(request, index))
            if block_id is None:
                break
            found.append(block_id)
        return found

    def _block_tokens(self, request: Request, index: int) -> list[int]:
        return request.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's block hashes, holding at least its first `num_blocks`; each is computed
        once per request."""
        hashes = request.block_hashes
        for index in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else salt_hash(request.cache_salt)
            hashes.append(chain_hash(parent, self._block_tokens(request, index)))
        return hashes

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached_prefix: list[int] | None = None,
        num_lookahead: int = 0,
        publish: bool = True,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False (and no change) if the
        pool is short.

        `cached_prefix` (from find_cached_prefix, only for a request holding no blocks) is shared
        first. `num_lookahead` more slots follow for draft tokens: they get blocks, but only blocks
        full of the request's own tokens are published in the prefix cache, never one a draft
        token fills (`trim` gives back what rejected drafts held). The blocks the new tokens fill
        are published now (the step that computes them runs before any later request reads them),
        or with `publish=False` only by a later `publish`, for tokens computed beside the steps.
        """
        cached_prefix = cached_prefix or []
        held = self._blocks.get(request.request_id, [])
        assert not (held and cached_prefix), (
            "a prefix hit is only taken by a request holding no blocks"
        )
        num_computed = (
            len(cached_prefix) * self.block_size if cached_prefix else request.num_computed_tokens
        )
        total = blocks_needed(num_computed + num_new_tokens + num_lookahead, self.block_size)
        num_new_blocks = max(0, total - len(held) - len(cached_prefix))
        # Sharing a free cached block removes it from the free list too.
        if num_new_blocks + self.pool.count_free_among(cached_prefix) > self.pool.num_free_blocks:
            return False
        self.pool.share(cached_prefix)
        blocks = self._blocks.setdefault(request.request_id, held)
        blocks.extend(cached_prefix)
        blocks.extend(self.pool.allocate(num_new_blocks))
        self.publish(request, num_computed + num_new_tokens if publish else num_computed)
        return True

    def publish(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that its first `num_tokens` tokens fill."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks[request.request_id]
        num_full = num_tokens // self.block_size
        hashes = self._block_hashes(request, num_full)
        for index in range(self._num_registered.get(request.request_id, 0), num_full):
            self.pool.register(blocks[index], hashes[index], self._block_tokens(request, index))
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens (the slots of rejected drafts).

        Such blocks were never published (only blocks full of known tokens are), so the prefix
        cache loses nothing; afterwards the request holds what a step without drafts leaves.
        """
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        keep = blocks_needed(request.num_computed_tokens, self.block_size)
        if keep >= len(blocks):
            return
        assert keep >= self._num_registered.get(request.request_id, 0), "trimming a cached block"
        surplus = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(surplus))

    def free(self, request: Request, keep_cached: bool = True) -> None:
        """Release every block of the request (tail first, so its prefix stays cached longest).

        `keep_cached=False` also drops the prefixes it published: used when its step failed and
        the KV it was to write may be missing.
        """
        blocks = self._blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        if not keep_cached:
            self.pool.uncache(blocks)
        self.pool.free(reversed(blocks))

    def check_integrity(self) -> None:
        held = Counter(block for blocks in self._blocks.values() for block in blocks)
        for request_id, blocks in self._blocks.items():
            assert len(set(blocks)) == len(blocks), f"{request_id} holds a block twice"
        self.pool.check_integrity(dict(held))
