"""Warming a new replica: copy the hottest known prefixes onto it from their best holders.

Every front door hands the controller its hot prompts (`HotPrefixMsg`s, `note_hot`); the
controller keeps the most used (`HotPrefixBook`). To warm a replica it asks the cache service
for estimates only (a dry-run `RouteRequestMsg`: no load booked, no request) and moves the pages
of any replica that would hit more of the prompt than the new one (`transfer_plan.better_holder`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from cache_service.block_hash import RequestBlockHashes
from cache_service.messages import RouteDecision, RouteRequestMsg
from cache_service.transfer_plan import better_holder
from cluster.messages import HotPrefixMsg

ROUTE_TIMEOUT_S = 10.0


class HotPrefixBook:
    """The hot prefixes of every front door: the larger use count wins, the oldest leave first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._uses: OrderedDict[tuple, int] = OrderedDict()  # (prompt prefix, salt) -> times served

    def merge(self, items: list[HotPrefixMsg]) -> None:
        with self._lock:
            for item in items:
                key = (tuple(item.prompt_token_ids), item.cache_salt)
                self._uses[key] = max(self._uses.pop(key, 0), item.num_uses)
            while len(self._uses) > self.capacity:
                self._uses.popitem(last=False)

    def hottest(self, limit: int | None = None) -> list[HotPrefixMsg]:
        with self._lock:
            ranked = sorted(self._uses.items(), key=lambda kv: -kv[1])
        return [HotPrefixMsg(prompt, salt, n) for (prompt, salt), n in ranked[: limit or len(ranked)]]


class Warmer:
    """`estimate(prompt, salt)`: the service's dry-run decision (None: unknown, stop warming);
    `transfer(prompt, salt, src, dst, num_tokens) -> bool`: the controller's page move."""

    def __init__(self, book: HotPrefixBook, estimate: Callable[[list[int], str | None], RouteDecision | None],
                 transfer: Callable[[list[int], str | None, str, str, int], bool]) -> None:
        self.book = book
        self.estimate = estimate
        self.transfer = transfer

    def warm(self, replica_id: str, limit: int | None = None) -> int:
        """Transfers done onto `replica_id`."""
        done = 0
        for item in self.book.hottest(limit):
            prompt = list(item.prompt_token_ids)
            decision = self.estimate(prompt, item.cache_salt)
            if decision is None:
                break
            holder = better_holder(decision, replica_id)
            if holder is not None:
                done += self.transfer(prompt, item.cache_salt, holder.replica_id, replica_id, holder.hit_tokens)
        return done


def dry_run_estimate(shards, hash_block_size: int, fingerprint: str, routable: Callable[[], list[str]],
                     prompt: list[int], salt: str | None) -> RouteDecision | None:
    """The cache service's estimates for `prompt` (no load booked; `shards`: a
    `service_shards.ServiceShards`); None when the service is down, knows no replica, or chose one
    that is not routable (draining, gone)."""
    hashes = tuple(RequestBlockHashes(hash_block_size, prompt, model_fingerprint=fingerprint, cache_salt=salt).hashes)
    msg = RouteRequestMsg(hashes, len(prompt), salt, 0, None, (), True)
    try:
        decision = shards.estimate(msg, ROUTE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - dead or restarting: nothing to warm from now
        return None
    if decision is None or decision.replica_id not in routable():
        return None
    return decision
