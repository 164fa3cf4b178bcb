"""The attention groups' managers (full, draft, sliding window) and the page-copy seam they share
with the Mamba manager. `group_managers.py` holds them all behind one interface; its docstring
says what every manager answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.block_pool import BlockPool, CacheBlock
from cache_service.coordinator import EagleMode, HybridCoordinator
from cache_service.hit_finders import DropRule
from cache_service.specs import GroupSpec, MambaSpec, SlidingWindowSpec


def retained_block_ends(
    spec, num_computed_tokens: int, checkpoints: Sequence[int], lookahead: bool = False
) -> list[int]:
    """Token positions at which group `spec` keeps a cached block (the block's end position).

    full/draft: every full block; sliding window: only the blocks covering each checkpoint's
    window tail, plus, for a group whose lookup drops by the lookahead rule (`lookahead`), the
    block starting at each checkpoint (the proof of its successor token); mamba: one state page
    per checkpoint."""
    size = spec.block_size
    if isinstance(spec, MambaSpec):
        return [c for c in checkpoints if c % size == 0]
    if isinstance(spec, SlidingWindowSpec):
        ends: set[int] = set()
        for c in checkpoints:
            first = max(0, c - (spec.window - 1)) // size
            ends.update((j + 1) * size for j in range(first, c // size))
            if lookahead and c % size == 0 and c + size <= num_computed_tokens:
                ends.add(c + size)
        return sorted(ends)
    return list(range(size, num_computed_tokens // size * size + 1, size))


class PageBackend(Protocol):
    def copy_page(self, group_id: int, src: int, dst: int) -> None:
        """Copy page `src` of group `group_id` into page `dst` (every layer, every TP rank)."""
        ...


class NullPageBackend:
    """No tensors: the simulations' backend."""

    def copy_page(self, group_id: int, src: int, dst: int) -> None:
        return None


class AttentionManager:
    """Full attention: a request's block table covers [0, n) for every n it has grown to."""

    def __init__(self, group_id: int, spec: GroupSpec, pool: BlockPool, coordinator: HybridCoordinator,
                 backend: PageBackend) -> None:
        self.group_id, self.spec, self.pool = group_id, spec, pool
        self.coordinator, self.backend = coordinator, backend
        self.block_size = spec.block_size
        self.req_to_blocks: dict[str, list[CacheBlock]] = {}
        self.num_published: dict[str, int] = {}

    # ---- admission ----------------------------------------------------------------------------
    def num_shared_blocks(self, hit_tokens: int) -> int:
        return hit_tokens // self.block_size

    def hit_blocks(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[CacheBlock | None]:
        """The cached blocks a hit of `hit_tokens` shares (None where not cached: `holds_hit`)."""
        return self._cached(hashes, 0, self.num_shared_blocks(hit_tokens))

    def hit_keys(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[BlockHash]:
        """The keys of every page a hit of `hit_tokens` restores: `hit_blocks`' and `copy_sources`'."""
        return self._block_keys(hashes, 0, self.num_shared_blocks(hit_tokens)) + self._copy_keys(hashes, hit_tokens)

    def _copy_keys(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[BlockHash]:
        return []

    def _block_keys(self, hashes: RequestBlockHashes, first: int, end: int) -> list[BlockHash]:
        """Prefix keys of this group's blocks [first, end) (block j ends at (j + 1) * block_size)."""
        step = self.block_size // hashes.hash_block_size
        keys = hashes.hashes[(first + 1) * step - 1: end * step: step]
        if len(keys) < end - first:
            hashes.prefix_hash(end * self.block_size)  # raises: the prefix is not hashed that far
        return keys

    def _cached(self, hashes: RequestBlockHashes, first: int, end: int) -> list[CacheBlock | None]:
        get = self.pool.cached.get
        return [get(k) for k in self._block_keys(hashes, first, end)]

    def copy_sources(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[CacheBlock]:
        """Cached pages restored by copy into a private page (none for plain attention)."""
        return []

    def num_blocks_needed(self, request_id: str, num_positions: int, decoding: bool = False) -> int:
        have = len(self.req_to_blocks.get(request_id, ()))
        return max(0, -(-num_positions // self.block_size) - have)

    def restore(self, request_id: str, hashes: RequestBlockHashes, hit_tokens: int) -> None:
        shared = self.hit_blocks(hashes, hit_tokens)
        self.pool.touch(shared)
        self.req_to_blocks[request_id] = shared
        self.num_published[request_id] = len(shared)

    def grow(self, request_id: str, num_positions: int, decoding: bool = False) -> None:
        need = self.num_blocks_needed(request_id, num_positions)
        if need:
            self.req_to_blocks[request_id].extend(self.pool.allocate(need))

    # ---- publication --------------------------------------------------------------------------
    def publish(self, request_id: str, hashes: RequestBlockHashes, num_computed: int,
                checkpoints: Sequence[int] = ()) -> int:
        """Publish every newly completed block under its prefix hash; returns how many became
        cached (a block whose prefix another block already holds stays private: first copy wins)."""
        size, done = self.block_size, self.num_published[request_id]
        if num_computed // size <= done:  # no block completed since the last call (most decode steps)
            return 0
        blocks = self.req_to_blocks[request_id]
        upto = min(num_computed, len(hashes.hashes) * hashes.hash_block_size, len(blocks) * size) // size
        if upto <= done:
            return 0
        num_new = sum(map(self.pool.cache_block, blocks[done:upto], self._block_keys(hashes, done, upto)))
        self.num_published[request_id] = upto
        return num_new

    def free(self, request_id: str) -> None:
        """Return the request's blocks tail first (its last blocks are evicted first)."""
        self.pool.free(reversed(self.req_to_blocks.pop(request_id, [])))
        self.num_published.pop(request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks[request_id]]

    def holds(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks


class FullAttentionManager(AttentionManager):
    pass


class DraftAttentionManager(AttentionManager):
    """Draft-layer KV. Lossless EAGLE: the block holding L-1 is not shared but copied, because
    the engine rewrites position L-1's draft KV with the true successor token."""

    @property
    def lossless(self) -> bool:
        return self.coordinator.eagle is EagleMode.LOSSLESS

    def num_shared_blocks(self, hit_tokens: int) -> int:
        n = hit_tokens // self.block_size
        return n - 1 if hit_tokens and self.lossless else n

    def copy_sources(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[CacheBlock]:
        return [self.pool.get_cached(key) for key in self._copy_keys(hashes, hit_tokens)]

    def _copy_keys(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[BlockHash]:
        if not (hit_tokens and self.lossless):
            return []
        return [hashes.prefix_hash(hit_tokens // self.block_size * self.block_size)]

    def restore(self, request_id: str, hashes: RequestBlockHashes, hit_tokens: int) -> None:
        (src,) = self.copy_sources(hashes, hit_tokens) or (None,)
        if src is not None:
            self.pool.touch([src])  # pinned before allocation recycles free cached pages
        super().restore(request_id, hashes, hit_tokens)
        if src is not None:
            self.grow(request_id, hit_tokens)
            self.backend.copy_page(self.group_id, src.block_id, self.req_to_blocks[request_id][-1].block_id)
            self.pool.free([src])


class SlidingWindowManager(AttentionManager):
    """Sliding-window attention: blocks wholly before the window of the next position are given
    back (their table entries become the null block); only the blocks retention wants (window
    tails at checkpoints, lookahead blocks) are published."""

    def hit_blocks(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[CacheBlock]:
        size, first = self.block_size, self._first_live(hit_tokens)
        return [self.pool.null_block if j < first else self.pool.get_cached(hashes.prefix_hash((j + 1) * size))
                for j in range(hit_tokens // size)]

    def hit_keys(self, hashes: RequestBlockHashes, hit_tokens: int) -> list[BlockHash]:
        size = self.block_size
        return [hashes.prefix_hash((j + 1) * size) for j in range(self._first_live(hit_tokens), hit_tokens // size)]

    def _first_live(self, num_positions: int) -> int:
        return max(0, num_positions - (self.spec.window - 1)) // self.block_size

    def publish(self, request_id: str, hashes: RequestBlockHashes, num_computed: int,
                checkpoints: Sequence[int] = ()) -> int:
        blocks, size, num_new = self.req_to_blocks[request_id], self.block_size, 0
        coord = self.coordinator
        lookahead = self.group_id in coord.dropping_groups and coord.drop_rule is DropRule.LOOKAHEAD
        hashed = len(hashes.hashes) * hashes.hash_block_size
        for end in retained_block_ends(self.spec, num_computed, checkpoints, lookahead):
            block = blocks[end // size - 1] if end <= min(hashed, len(blocks) * size) else self.pool.null_block
            if block is not self.pool.null_block and block.block_hash is None:
                num_new += self.pool.cache_block(block, hashes.prefix_hash(end))
        first = self._first_live(num_computed)
        dead = [b for b in blocks[:first] if b is not self.pool.null_block]
        self.pool.free(dead)
        blocks[:first] = [self.pool.null_block] * first
        return num_new
