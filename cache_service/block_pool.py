"""A pool of fixed-size cache blocks (attention KV blocks or Mamba state pages) for one group.

    block ids:   0 (null) | 1 .. num_blocks-1
    each block:  ref_cnt > 0  -> in use by running requests (never evicted)
                 ref_cnt == 0 -> in the free queue, LRU first; may still be cached (hash set)
    cached:      block_hash -> block   (a prefix key, see block_hash.py)

Allocation takes from the head of the free queue and evicts that block's cached hash (a
`removed` event). Freed blocks that hold a cached hash go to the tail, so the least recently used
cached block is the next one evicted; freed blocks that hold none (a partial last block, KV
recomputed past a hit whose first copy is cached elsewhere, a working Mamba page) go to the head:
reusing them costs nothing, so they are taken before any cached block is evicted. The null
block is a real object (never -1): it pads block tables for sliding-window positions that hold
nothing, is never freed, cached or evicted.

    free queue   empty blocks (head) | cached blocks kept, LRU order (tail: most recent)
    spare queue  cached blocks the pool's `keeps` hook says no hit can use now (an attention
                 block above every retained Mamba state of its prefix: `kv_support.py`), in the
                 order they became spare; taken after the empty blocks, before any kept one

Without a `keeps` hook (a model with no Mamba group, the `lru` policy) the spare queue stays
empty and every cached block is evicted in LRU order. The hook's owner calls `reconsider` when
its answer for a cached hash changes.

With a host tier (`host`, `host_tier.py`) an evicted kept block is demoted there (its page copied
before the block is reused) instead of dropped; a spare one is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from cache_service.block_hash import BlockHash
from cache_service.events import EventSink
from cache_service.host_tier import HostTier


class PoolExhaustedError(RuntimeError):
    """Asked for more blocks than are free; callers check `can_allocate` first."""


class CacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        tag = self.block_hash.hex()[:8] if self.block_hash else "-"
        return f"CacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={tag})"


class BlockPool:
    def __init__(self, num_blocks: int, group_id: int = 0, events: EventSink | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.group_id = group_id
        self.events = events if events is not None else EventSink(enabled=False)
        self.blocks = [CacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self._free: OrderedDict[int, CacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._spare: OrderedDict[int, CacheBlock] = OrderedDict()  # free, cached, not kept
        self.cached: dict[BlockHash, CacheBlock] = {}
        self._num_free_empty = num_blocks - 1  # free blocks that hold no cached hash
        self.keeps: Callable[[BlockHash], bool] | None = None  # None: every cached block is kept
        self.host: HostTier | None = None  # where evicted kept blocks go (None: dropped)
        self.num_evictions = 0  # cached hashes dropped to make room or by a policy (device only)

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._spare)

    @property
    def num_spare_blocks(self) -> int:
        """Free cached blocks no hit can use now (evicted right after the empty ones)."""
        return len(self._spare)

    @property
    def num_free_empty_blocks(self) -> int:
        """Free blocks that hold nothing: allocating up to this many evicts nothing."""
        return self._num_free_empty

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + len(self._spare)

    # ---- allocation -----------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[CacheBlock]:
        """Take `num_blocks` blocks (ref_cnt 1 each) from the head of the free queue: blocks that
        hold nothing first (`free` puts them there), then spare ones, then kept ones in LRU order,
        evicted."""
        if not self.can_allocate(num_blocks):
            raise PoolExhaustedError(f"group {self.group_id}: {num_blocks} blocks asked, "
                                     f"{self.num_free_blocks} free")
        out, evicted = [], []
        for _ in range(num_blocks):
            queue = self._spare if self._spare and not self._num_free_empty else self._free
            _, block = queue.popitem(last=False)
            if block.block_hash is not None:
                if self.host is not None and queue is self._free:
                    self.host.demote(block.block_hash, block.block_id)
                evicted.append(block.block_hash)
                self._uncache(block)
            else:
                self._num_free_empty -= 1
            block.ref_cnt = 1
            out.append(block)
        self.num_evictions += len(evicted)
        self.events.removed(self.group_id, tuple(evicted))
        return out

    def touch(self, blocks: Iterable[CacheBlock]) -> None:
        """Take a reference on cached blocks a request is reusing (removes them from the free queue)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                if self._spare.pop(block.block_id, None) is None:
                    del self._free[block.block_id]
                self._num_free_empty -= block.block_hash is None
            block.ref_cnt += 1

    def free(self, blocks: Iterable[CacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue: at the tail if cached
        (kept, evicted in LRU order), at the head if they hold nothing (reused first). Pass a
        request's blocks tail-first so its last blocks are evicted first."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block!r} in group {self.group_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)
                    self._num_free_empty += 1
                elif self.keeps is None or self.keeps(block.block_hash):
                    self._free[block.block_id] = block
                else:
                    self._spare[block.block_id] = block

    def reconsider(self, block_hash: BlockHash) -> None:
        """The `keeps` hook's answer for `block_hash` may have changed: a free block holding it
        moves between the spare queue and the kept queue's tail (most recent)."""
        block = self.cached.get(block_hash)
        if block is None or block.ref_cnt or self.keeps is None:
            return
        keep = self.keeps(block_hash)
        if keep and self._spare.pop(block.block_id, None) is not None:
            self._free[block.block_id] = block
        elif not keep and self._free.pop(block.block_id, None) is not None:
            self._spare[block.block_id] = block

    # ---- caching --------------------------------------------------------------------------
    def get_cached(self, block_hash: BlockHash) -> CacheBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: CacheBlock, block_hash: BlockHash) -> bool:
        """Publish a full block under its prefix hash. False if that hash is already cached by
        another block (the first copy wins; this one stays private) or this block has a hash."""
        if block is self.null_block:
            raise ValueError("the null block is never cached")
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if block.ref_cnt == 0:  # a free empty block becomes a cached one: the kept queue's tail
            self._num_free_empty -= 1
            self._free.move_to_end(block.block_id)
            self.reconsider(block_hash)
        self.events.stored(self.group_id, (block_hash,))
        return True

    def evict(self, block_hash: BlockHash) -> bool:
        """Drop a cached hash whose block is free (an eviction policy's victim; tests). With a host
        tier, its page is copied there first."""
        block = self.cached.get(block_hash)
        if block is None or block.ref_cnt:
            return False
        if self.host is not None:
            self.host.demote(block_hash, block.block_id)
        self._uncache(block)
        if self._spare.pop(block.block_id, None) is not None:
            self._free[block.block_id] = block
        self._free.move_to_end(block.block_id, last=False)  # now empty: reused before any cached block
        self._num_free_empty += 1
        self.num_evictions += 1
        self.events.removed(self.group_id, (block_hash,))
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use. Emits one `cleared` event."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self._free.update(self._spare)
        self._spare.clear()
        for block in list(self.cached.values()):
            self._uncache(block)
        self._num_free_empty = len(self._free)
        if self.host is not None:
            self.host.clear()
        self.events.cleared(self.group_id)
        return True

    def _uncache(self, block: CacheBlock) -> None:
        del self.cached[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = None

    # ---- invariants -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any pool invariant is broken (used by tests after each step)."""
        null = self.null_block
        assert null.ref_cnt >= 1 and null.block_hash is None and null.block_id not in self._free, "null block"
        assert not self._free.keys() & self._spare.keys(), "a block in both free queues"
        for block in self.blocks[1:]:
            in_free = block.block_id in self._free or block.block_id in self._spare
            assert block.ref_cnt >= 0, f"negative ref count: {block!r}"
            assert in_free == (block.ref_cnt == 0), f"free-queue membership wrong: {block!r}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"cached map misses {block!r}"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"stale cached entry for {block!r}"
        assert all(q[i] is self.blocks[i] for q in (self._free, self._spare) for i in q), \
            "free queue holds foreign blocks"
        assert all(b.block_hash is not None for b in self._spare.values()), "an empty block in the spare queue"
        if self.keeps is not None:
            assert not any(self.keeps(b.block_hash) for b in self._spare.values()), "a kept block in the spare queue"
            assert all(b.block_hash is None or self.keeps(b.block_hash) for b in self._free.values()), \
                "a spare block in the kept queue"
        else:
            assert not self._spare, "spare blocks without a keeps hook"
        if self.host is not None:
            self.host.check_integrity()
        cached = [b.block_hash is not None for b in self._free.values()]
        assert self._num_free_empty == cached.count(False), "count of empty free blocks wrong"
        assert cached == sorted(cached), "an empty free block waits behind a cached one (it must be reused first)"
