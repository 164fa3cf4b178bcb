"""Mamba state page copies of one step, batched.

A verify chunk that rejects some drafts rolls its working page back to the state after the last accepted
token (a copy from one of its per-token verify pages). Done one request at a time that is a gather and a
scatter per pool and Mamba layer per request (16 operator calls per request on a 4-Mamba-layer model); the
step queues them and `flush` copies every pair in one gather and one scatter per pool and layer.

Ordering: a queued copy must land before anything reads its destination (the working page) or reuses its
source. The engine flushes after its per-chunk loop (before the drafter, publication and the next step)
and before finishing a request (whose pages are then snapshotted and given back).
"""

from __future__ import annotations


class PendingStateCopies:
    def __init__(self, caches) -> None:
        """`caches`: ModelCaches (or the TP proxy's), whose `copy_states(srcs, dsts)` runs the batch."""
        self.caches = caches
        self._src: list[int] = []
        self._dst: list[int] = []

    def add(self, src_page: int, dst_page: int) -> None:
        """Queue `dst_page := src_page` (all Mamba layers, conv + ssm)."""
        self._src.append(src_page)
        self._dst.append(dst_page)

    def __len__(self) -> int:
        return len(self._src)

    def flush(self) -> None:
        """Copy every queued pair (at once) and forget them."""
        if self._src:
            src, dst = self._src, self._dst
            self._src, self._dst = [], []
            self.caches.copy_states(src, dst)
