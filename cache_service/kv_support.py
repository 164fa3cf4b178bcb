"""Which cached attention blocks a retained Mamba state makes usable: KV valued jointly with the
states of its prefix.

A hybrid hit at L needs the Mamba state at L and every attention block below L (and, when a group
drops under EAGLE, the block starting at L). So a cached KV block is worth keeping only while
some retained state sits at or above it on its prefix; past the deepest one it serves no hit
(`BlockPool`'s spare queue evicts such blocks before any other cached one, after the empty ones).

Prefixes form a tree whose nodes are prefix hashes (one per `hash_block_size` tokens). Each node
counts the states anchored on it plus its children that are live; a node is live (its blocks
kept) while its count is above 0:

    stored at L    anchor = the node at L + reach on the storing request's prefix (reach: one
                   alignment unit when some group drops, else 0), count += 1 there, and up the
                   parents while a count goes 0 -> 1 (stops at the first node already live)
    removed        count -= 1 at its anchor, and up the parents while a count goes 1 -> 0

so both cost the length of the prefix segment that changes state, not the whole prefix. Each
node keeps the parent it was reached from; a state registered without its prefix (a transfer,
adopted by `MambaManager`) anchors on its own node only. Nodes no state ever reached are not
kept: a block above every state of its prefix, or one whose state was never admitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.block_pool import BlockPool


class KvSupport:
    """Live-node counts over the prefix tree, and the attention pools they steer."""

    def __init__(self, pools: Sequence[BlockPool], reach_tokens: int = 0) -> None:
        """`pools`: the attention groups' pools (their `keeps` hook becomes `self.keeps`);
        `reach_tokens`: how far above a state's position its hit needs KV (EAGLE drop)."""
        self.pools = list(pools)
        self.reach_tokens = reach_tokens
        self._count: dict[BlockHash, int] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._anchor: dict[tuple[int, BlockHash], BlockHash] = {}  # (Mamba group, state key) -> node
        for pool in self.pools:
            pool.keeps = self.keeps

    def keeps(self, key: BlockHash) -> bool:
        """Whether a cached block under `key` can serve a hit (some retained state at or above it)."""
        return key in self._count

    @property
    def num_live_nodes(self) -> int:
        return len(self._count)

    def stored(self, group_id: int, key: BlockHash, hashes: RequestBlockHashes | None, position: int) -> None:
        """A state of Mamba group `group_id` was retained under `key` (the prefix of `position`
        tokens of `hashes`; `hashes` None: registered without its prefix)."""
        if (group_id, key) in self._anchor:
            return
        if hashes is None or position <= 0:
            chain, top = [key], 0
        else:
            size = hashes.hash_block_size
            chain = hashes.hashes
            top = min(position + self.reach_tokens, len(chain) * size) // size - 1
            if top < 0:  # below the first whole hash unit: no KV block to keep, its own node only
                chain, top = [key], 0
        self._anchor[(group_id, key)] = chain[top]
        count, parent = self._count, self._parent
        for i in range(top, -1, -1):
            node = chain[i]
            before = count.get(node, 0)
            count[node] = before + 1
            if before:
                return
            parent[node] = chain[i - 1] if i else None
            self._changed(node)

    def removed(self, group_id: int, key: BlockHash) -> None:
        """A state of group `group_id` under `key` left its pool (unknown keys are ignored)."""
        node = self._anchor.pop((group_id, key), None)
        count, parent = self._count, self._parent
        while node is not None:
            left = count[node] - 1
            if left:
                count[node] = left
                return
            del count[node]
            up = parent.pop(node)
            self._changed(node)
            node = up

    def _changed(self, node: BlockHash) -> None:
        for pool in self.pools:
            if node in pool.cached:
                pool.reconsider(node)
            if pool.host is not None:
                pool.host.reconsider(node)
