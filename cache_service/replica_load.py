"""Each replica's load as the cache service sees it: the replica's own last report plus the work
routed to it since that the report cannot include yet.

Replicas report (`messages.LoadReportMsg`) with every pushed event batch, at least every
heartbeat. Between two reports a burst of decisions would all see the same stale number and
herd onto one replica, so every decision adds its cost to the chosen replica's `pending` list;
a report saying the replica has accepted k more requests retires the k oldest pending entries
(their work is now in the reported queue). Entries older than `pending_ttl_s` are dropped so a
request that never arrived (its front door died) does not count forever.

`by_load()` keeps every replica in order of load (a sorted list updated on each change, O(log R)
to find, a C memmove to move), so a decision finds the least loaded replica without looking at
all of them. The cache service `ensure`s an entry (load 0) for every replica it indexes.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cache_service.messages import HostCopyPrice, LoadReportMsg


@dataclass
class _Load:
    report: LoadReportMsg = field(default_factory=LoadReportMsg)
    pending: deque = field(default_factory=deque)  # (time, tokens) routed, not yet in a report
    pending_tokens: int = 0
    reported: bool = False


class LoadBook:
    def __init__(self, pending_ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self._loads: dict[str, _Load] = {}
        self.current: dict[str, int] = {}  # replica -> queued tokens (report + pending), kept up to date
        self._order: list[tuple[int, str]] = []  # (current, replica), ascending
        self._next_expiry = 0.0

    def _set(self, replica_id: str, tokens: int) -> None:
        old = self.current.get(replica_id)
        if old == tokens:
            return
        if old is not None:
            del self._order[bisect_left(self._order, (old, replica_id))]
        insort(self._order, (tokens, replica_id))
        self.current[replica_id] = tokens

    def ensure(self, replica_id: str) -> None:
        """An entry for `replica_id` (load 0 until it reports)."""
        if replica_id not in self.current:
            self._loads.setdefault(replica_id, _Load())
            self._set(replica_id, 0)

    def by_load(self) -> list[tuple[int, str]]:
        """(queued tokens, replica) of every replica with an entry, least loaded first (after
        `view()`'s expiry; the list itself: do not change it)."""
        self.view()
        return self._order

    def report(self, replica_id: str, report: LoadReportMsg) -> None:
        load = self._loads.setdefault(replica_id, _Load())
        arrived = max(0, report.num_accepted - load.report.num_accepted)
        for _ in range(min(arrived, len(load.pending))):
            load.pending_tokens -= load.pending.popleft()[1]
        load.report, load.reported = report, True
        self._set(replica_id, report.num_queued_tokens + load.pending_tokens)

    def add_pending(self, replica_id: str, tokens: int, at: float | None = None) -> None:
        """`at`: when it was booked (default now; a snapshot's entries keep their age)."""
        load = self._loads.setdefault(replica_id, _Load())
        load.pending.append((self.clock() if at is None else at, tokens))
        load.pending_tokens += tokens
        self._set(replica_id, load.report.num_queued_tokens + load.pending_tokens)

    def view(self) -> dict[str, int]:
        """`current`, after dropping expired pending entries (checked at most every 0.1 s)."""
        now = self.clock()
        if now >= self._next_expiry:
            self._next_expiry = now + 0.1
            for r in [r for r, load in self._loads.items() if load.pending]:
                self.queued_tokens(r)
        return self.current

    def queued_tokens(self, replica_id: str) -> int:
        load = self._loads.get(replica_id)
        if load is None:
            return 0
        horizon = self.clock() - self.pending_ttl_s
        while load.pending and load.pending[0][0] < horizon:
            load.pending_tokens -= load.pending.popleft()[1]
        self._set(replica_id, load.report.num_queued_tokens + load.pending_tokens)
        return self.current[replica_id]

    def num_requests(self, replica_id: str) -> int:
        load = self._loads.get(replica_id)
        return 0 if load is None else load.report.num_requests + len(load.pending)

    def free_blocks(self, replica_id: str) -> int | None:
        """Attention blocks free or evictable at the replica's last report (None: none yet)."""
        load = self._loads.get(replica_id)
        return load.report.num_free_blocks if load is not None and load.reported else None

    def empty_blocks(self, replica_id: str) -> int | None:
        """Attention blocks free and holding no cached page at the replica's last report (None:
        none yet, or a replica that does not report them)."""
        load = self._loads.get(replica_id)
        return load.report.num_empty_blocks if load is not None and load.reported else None

    def host_copy(self, replica_id: str) -> HostCopyPrice | None:
        """The replica's last measured price of a host hit (None: never reported one)."""
        load = self._loads.get(replica_id)
        return None if load is None else load.report.host_copy

    def forget(self, replica_id: str) -> None:
        self._loads.pop(replica_id, None)
        old = self.current.pop(replica_id, None)
        if old is not None:
            del self._order[bisect_left(self._order, (old, replica_id))]

    def snapshot(self) -> dict[str, dict]:
        return {r: {"queued_tokens": self.queued_tokens(r), "requests": self.num_requests(r),
                    "free_blocks": load.report.num_free_blocks, **_empty_view(load.report.num_empty_blocks),
                    **_price_view(load.report.host_copy)}
                for r, load in self._loads.items()}


def _empty_view(num_empty_blocks: int | None) -> dict:
    """A replica's reported empty blocks as the service's `stats()` shows them (none reported: nothing)."""
    return {} if num_empty_blocks is None else {"empty_blocks": num_empty_blocks}


def _price_view(price: HostCopyPrice | None) -> dict:
    """A measured host-hit price as /stats shows it (nothing when none was reported)."""
    if price is None:
        return {}
    return {"host_copy": {"fixed_tokens": round(price.fixed, 3), "tokens_per_token": round(price.per_token, 5),
                          "bytes_per_s": round(price.bytes_per_s)}}
