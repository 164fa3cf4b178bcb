"""The host tier: a second level under one group's device pool, holding pages the device evicted.

    device pool (BlockPool)        host tier (HostTier)
    cached block evicted   ----->  demote: the page is copied into a host slot under its prefix
                                   hash (no copy when the host holds that hash already)
    hit on a host-only key <-----  promote: a fresh device page, the host slot copied into it,
                                   cached again under the hash (the host keeps its copy: evicting
                                   it again from the device costs no copy)

Inclusive after a promotion, exclusive otherwise: a key is on the device, on the host, or both.
Lookups (`local_cache.PoolLookup`) treat a host key as cached; admission
(`GroupManagers.admit`) promotes every host-only page of a hit before restoring it.

Which host page goes when the host is full: attention blocks that no retained state (on either
tier) makes usable any more first (`keeps`, the pool's `kv_support.py` hook; the spare order,
told by `reconsider`), then least recently demoted or promoted; Mamba states by a policy object
of the device's own kind (`eviction.py`: lru, marconi or value), which also decides whether a
state is worth demoting at all (`admits`). A spare attention block is not demoted.

Copies go through a `HostBackend` (the engine's copies tensors, issued on the device's stream so
they overlap compute and no request waits on one; `NullHostBackend` for simulations). Keys being
promoted are pinned (`pin`) so that the demotions their own device pages cause cannot push them
out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from cache_service.block_hash import BlockHash
from cache_service.events import EventSink
from cache_service.eviction_policy import CheckpointEviction


class HostBackend(Protocol):
    def save_page(self, group_id: int, block_id: int, slot: int) -> None:
        """Copy device page `block_id` of group `group_id` into host slot `slot`."""
        ...

    def load_page(self, group_id: int, slot: int, block_id: int) -> None:
        """Copy host slot `slot` of group `group_id` into device page `block_id`."""
        ...


class NullHostBackend:
    """No tensors: the simulations' backend."""

    def save_page(self, group_id: int, block_id: int, slot: int) -> None:
        return None

    def load_page(self, group_id: int, slot: int, block_id: int) -> None:
        return None


class HostTier:
    """One group's host pages: `num_pages` slots keyed by prefix hash."""

    def __init__(self, group_id: int, num_pages: int, backend: HostBackend | None = None,
                 policy: CheckpointEviction | None = None, events: EventSink | None = None) -> None:
        """`policy`: for a Mamba group, the eviction policy of its host level (None: LRU, the
        attention groups' order); `events`: the replica's sink (the cluster index keeps the tier)."""
        if num_pages < 1:
            raise ValueError(f"a host tier needs at least 1 page, got {num_pages}")
        self.group_id = group_id
        self.num_pages = num_pages
        self.backend = backend if backend is not None else NullHostBackend()
        self.policy = policy
        self.events = events if events is not None else EventSink(enabled=False)
        self.slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        # attention groups under a joint-KV policy: whether a state still makes a block usable
        self.keeps: Callable[[BlockHash], bool] | None = None
        self._spare: OrderedDict[BlockHash, None] = OrderedDict()  # held keys `keeps` says no hit can use
        self._free_slots = list(range(num_pages - 1, -1, -1))
        self._pinned: set[BlockHash] = set()
        # set by the owner: a Mamba state's position on its device (what the host policy ranks by)
        self.position_of: Callable[[BlockHash], int] = lambda key: 0
        # set by the owner: told of every key leaving the host (kv_support's count of states)
        self.on_dropped: Callable[[BlockHash], None] = lambda key: None
        self.num_demoted = 0  # pages copied to the host
        self.num_promoted = 0  # pages copied back to the device
        self.num_dropped = 0  # host pages evicted to make room
        self.num_refused = 0  # demotions the host policy did not admit

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def tick(self) -> None:
        """A request was admitted (the host policy's clock)."""
        if self.policy is not None:
            self.policy.tick()

    # ---- demotion -----------------------------------------------------------------------------
    def demote(self, key: BlockHash, block_id: int) -> bool:
        """The device evicts page `block_id` cached under `key`: keep a copy here. False when the
        host would not take it (full of pinned pages, or the policy ranks it below every host page)."""
        if key in self.slots:
            self._used(key, restored=False)
            return True
        if not self._free_slots and not self._make_room(key):
            self.num_refused += 1
            return False
        slot = self._free_slots.pop()
        self.backend.save_page(self.group_id, block_id, slot)
        self.slots[key] = slot
        self.reconsider(key)
        if self.policy is not None:
            self.policy.stored(key, self.position_of(key), 0)
        self.events.host_stored(self.group_id, (key,))
        self.num_demoted += 1
        return True

    def _make_room(self, key: BlockHash) -> bool:
        victim = self._victim()
        if victim is None:
            return False
        if self.policy is not None and not self.policy.admits(self.position_of(key), 0, victim):
            return False
        self.drop(victim)
        self.num_dropped += 1
        return True

    def _victim(self) -> BlockHash | None:
        if self.policy is not None:
            return self.policy.victim(lambda k: None if k not in self.slots else k not in self._pinned)
        spare = next((k for k in self._spare if k not in self._pinned), None)
        return spare if spare is not None else next((k for k in self.slots if k not in self._pinned), None)

    def reconsider(self, key: BlockHash) -> None:
        """`keeps`' answer for a held key may have changed: it joins or leaves the spare order."""
        if self.keeps is None or key not in self.slots:
            return
        if self.keeps(key):
            self._spare.pop(key, None)
        else:
            self._spare[key] = None

    # ---- promotion ----------------------------------------------------------------------------
    def promote(self, key: BlockHash, block_id: int, position: int = 0) -> None:
        """Copy the host page of `key` into device page `block_id` (the caller caches it there)."""
        self.backend.load_page(self.group_id, self.slots[key], block_id)
        self._used(key, restored=True, position=position)
        self.num_promoted += 1

    def _used(self, key: BlockHash, restored: bool, position: int = 0) -> None:
        self.slots.move_to_end(key)
        if self.policy is not None:
            self.policy.used(key, restored, position)

    def pin(self, keys: Iterable[BlockHash]) -> None:
        """Keep `keys` (pages about to be promoted) from being evicted until `unpin`."""
        self._pinned.update(keys)

    def unpin(self) -> None:
        self._pinned.clear()

    # ---- removal ------------------------------------------------------------------------------
    def drop(self, key: BlockHash, announce: bool = True) -> bool:
        """Forget the host page of `key` (its slot is reused)."""
        slot = self.slots.pop(key, None)
        if slot is None:
            return False
        self._free_slots.append(slot)
        self._spare.pop(key, None)
        if self.policy is not None:
            self.policy.removed(key)
        if announce:
            self.events.host_removed(self.group_id, (key,))
        self.on_dropped(key)
        return True

    def clear(self) -> None:
        """Forget every page (the pool's reset: its `cleared` event covers both tiers)."""
        for key in list(self.slots):
            self.drop(key, announce=False)

    def check_integrity(self) -> None:
        slots = list(self.slots.values())
        assert len(set(slots)) == len(slots), "a host slot holds two keys"
        assert not set(slots) & set(self._free_slots), "a host slot both free and used"
        assert len(slots) + len(self._free_slots) == self.num_pages, "host slots lost"
        assert all(0 <= s < self.num_pages for s in slots), "a host slot out of range"
        assert self._spare.keys() <= self.slots.keys(), "a spare key not held"
        if self.keeps is not None:
            assert all(not self.keeps(k) for k in self._spare), "a usable block in the spare order"
            assert all(k in self._spare for k in self.slots if not self.keeps(k)), "a spare block not in the order"
