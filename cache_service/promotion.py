"""Promotion: the pages of a hit that only the host tier holds, copied back to the device before
the hit is restored (`GroupManagers.admit`; the engine and every simulation alike).

    1. pin      the hit's device pages (touch) and its host-only keys (HostTier.pin), so that
                the pages taken next cannot evict either
    2. promote  per host-only key: a fresh device page (its eviction may demote another page),
                the host page copied into it, cached under the key again
    3. restore  the managers restore the hit as if every page had been on the device
    4. release  the pins of step 1 (`Promotion.release`)

`host_only` answers the check-then-act question: how many extra device pages admitting a hit
takes, per group. `pin_keys` does steps 1-2 for a list of keys of one pool: a hit's pages of one
group, or a transfer's source pages, which may sit on the holder's host tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.block_pool import CacheBlock


def host_only(manager, hashes: RequestBlockHashes, hit_tokens: int) -> list[BlockHash]:
    """The keys of a hit's pages that group `manager` holds on its host tier only."""
    host = manager.pool.host
    if host is None or not hit_tokens:
        return []
    cached = manager.pool.cached
    return list(dict.fromkeys(k for k in manager.hit_keys(hashes, hit_tokens) if k not in cached and k in host))


@dataclass
class Promotion:
    """What one admission promoted: pages per group, and the pins to release once restored."""

    num_pages: list[int]
    pins: list[tuple[object, list[CacheBlock]]] = field(default_factory=list)

    def release(self) -> None:
        for manager, blocks in self.pins:
            manager.pool.free(blocks)
        self.pins = []


def promote_hit(managers: Sequence, hashes: RequestBlockHashes, hit_tokens: int) -> Promotion:
    """Steps 1-2 of the module doc, per group with host-only pages (`pin_keys`; a group's pages
    never evict another's). The caller checked the room (`host_only` pages per group on top of
    what the hit needs without a host tier)."""
    result = Promotion([0] * len(managers))
    for g, m in enumerate(managers):
        num_missing = len(host_only(m, hashes, hit_tokens))
        if not num_missing:
            continue
        held = pin_keys(m.pool, m.hit_keys(hashes, hit_tokens), hit_tokens)
        if held is None:
            raise RuntimeError(f"group {g}: no room to promote {num_missing} pages of a hit admission checked")
        result.num_pages[g] = num_missing
        result.pins.append((m, held))
    return result


def _promote(pool, keys: Sequence[BlockHash], position: int) -> list[CacheBlock]:
    """Copy host-only `keys` into fresh device pages, cached under them (each held once)."""
    out = []
    try:
        for key in keys:
            (block,) = pool.allocate(1)
            pool.host.promote(key, block.block_id, position)
            pool.cache_block(block, key)
            out.append(block)
    finally:
        pool.host.unpin()
    return out


def pin_keys(pool, keys: Sequence[BlockHash], position: int = 0) -> list[CacheBlock] | None:
    """Hold a reference on the device page of every key (once each, in key order), promoting those
    only the host tier has (`position`: the hit's, for the host policy; 0: unknown); None (nothing
    held) when a key is on neither tier or the device has no room to promote. Release with
    `pool.free`."""
    cached, host = pool.cached, pool.host
    missing = list(dict.fromkeys(k for k in keys if k not in cached))
    if missing and (host is None or any(k not in host for k in missing)):
        return None
    present = list(dict.fromkeys(cached[k] for k in keys if k in cached))
    if missing and not pool.can_allocate(len(missing) + sum(1 for b in present if not b.ref_cnt)):
        return None
    pool.touch(present)
    if missing:
        host.pin(missing)
        present += _promote(pool, missing, position)
    by_key = {b.block_hash: b for b in present}
    return [by_key[k] for k in dict.fromkeys(keys)]
