"""Prefix-page transfers between replicas, and warming a new replica with the hottest prefixes.

A transfer moves the pages serving a hit from `src` to `dst` over their pair channel (one at a
time per ordered pair: they share one channel); any failure is logged and the request
recomputes. Recently served prompts are remembered (by use count) so that a new replica can be
warmed with the hottest of them, each copied from its best holder.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import ray

from cache_service.messages import RouteDecision

log = logging.getLogger(__name__)

ENDPOINT_TIMEOUT_S = 10.0


def better_holder(decision: RouteDecision, target: str):
    """The replica that would hit more of the prompt than `target` does, or None."""
    here = decision.hit_on(target)
    holder = max(decision.estimates, key=lambda e: e.hit_tokens, default=None)
    if holder is not None and holder.replica_id != target and holder.hit_tokens > here:
        return holder
    return None


def plan_transfer(decision: RouteDecision, target: str) -> tuple[str, str, int] | None:
    """(src, dst, tokens) to move before serving on `target`: the service's plan, or the pages of
    a better holder when `target` was forced; None if nothing should move."""
    if decision.transfer is not None and decision.transfer.dst_replica == target:
        return decision.transfer.src_replica, target, decision.transfer.num_tokens
    holder = better_holder(decision, target)
    return (holder.replica_id, target, holder.hit_tokens) if holder is not None else None


class Transfers:
    def __init__(self, replicas, alignment: int, timeout_s: float = 120.0, hot_prefixes: int = 32) -> None:
        """`replicas`: the `ReplicaSet` (actors by id)."""
        self.replicas = replicas
        self.alignment = alignment
        self.timeout_s = timeout_s
        self.hot_prefixes = hot_prefixes
        self.counters = {"transfers": 0, "transfer_failures": 0}
        self.metrics = None
        self._lock = threading.Lock()
        self._pair_locks: dict[tuple[str, str], threading.Lock] = {}
        self._channel_gen: dict[tuple[str, str], int] = {}  # (src, dst) -> channel generation
        self._hot: OrderedDict[tuple, int] = OrderedDict()  # (prompt prefix, salt) -> times served

    def transfer(self, prompt_token_ids: list[int], cache_salt: str | None, src: str, dst: str,
                 num_tokens: int) -> bool:
        """Move the pages serving a `num_tokens` hit src -> dst; on any failure log why and return
        False (the request then recomputes)."""
        t0 = time.perf_counter()
        with self._lock:
            pair_lock = self._pair_locks.setdefault((src, dst), threading.Lock())
        try:
            with pair_lock:
                s, d = self.replicas.get(src), self.replicas.get(dst)
                if s is None or d is None:
                    raise RuntimeError(f"{src if s is None else dst} is gone")
                endpoint = ray.get(s.actor.channel_endpoint.remote(), timeout=ENDPOINT_TIMEOUT_S)
                gen = self._channel_gen.get((src, dst), 0)  # a fresh pair after a failure
                sent = s.actor.send_prefix.remote(prompt_token_ids, cache_salt, num_tokens, dst, gen)
                received = d.actor.recv_prefix.remote(src, endpoint, gen)
                nbytes, _ = ray.get([sent, received], timeout=self.timeout_s)
            self.counters["transfers"] += 1
            ok = True
        except Exception as exc:  # noqa: BLE001 - any failure falls back to recompute
            log.warning("transfer %s -> %s of %d tokens failed (%s): recomputing", src, dst, num_tokens, exc)
            self.counters["transfer_failures"] += 1
            self._channel_gen[(src, dst)] = self._channel_gen.get((src, dst), 0) + 1
            for a, b in ((src, dst), (dst, src)):
                rep = self.replicas.get(a)
                if rep is not None:
                    rep.actor.drop_channel.remote(b)
            nbytes, ok = 0, False
        if self.metrics is not None and hasattr(self.metrics, "record_transfer"):
            self.metrics.record_transfer(ok, time.perf_counter() - t0, nbytes)
        return ok

    def forget_replica(self, replica_id: str) -> None:
        for rep in list(self.replicas.replicas.values()):
            rep.actor.drop_channel.remote(replica_id)

    # ---- warming ------------------------------------------------------------------------------
    def remember(self, prompt: list[int], salt: str | None) -> None:
        """Keep the most recently served prompts (by use count), to warm new replicas with."""
        length = (len(prompt) - 1) // self.alignment * self.alignment
        if length <= 0:
            return
        key = (tuple(prompt[: length + 1]), salt)
        with self._lock:
            self._hot[key] = self._hot.pop(key, 0) + 1
            while len(self._hot) > self.hot_prefixes:
                self._hot.popitem(last=False)

    def hot_items(self) -> list:
        from cluster.messages import HotPrefixMsg

        with self._lock:
            return [HotPrefixMsg(prompt, salt, n) for (prompt, salt), n in self._hot.items()]

    def merge_hot(self, items) -> None:
        """Fold another front door's hot prefixes (`HotPrefixMsg`s) into this list."""
        with self._lock:
            for item in items:
                key = (tuple(item.prompt_token_ids), item.cache_salt)
                self._hot[key] = max(self._hot.pop(key, 0), item.num_uses)
            while len(self._hot) > self.hot_prefixes:
                self._hot.popitem(last=False)

    def warm(self, replica_id: str, route, limit: int | None = None) -> int:
        """Copy the hottest known prefixes onto `replica_id` from their holders; `route(prompt,
        salt)` gives a decision (or None when the index is down). Returns transfers done."""
        with self._lock:
            hot = sorted(self._hot.items(), key=lambda kv: -kv[1])[: limit or len(self._hot)]
        done = 0
        for (prompt, salt), _ in hot:
            decision = route(list(prompt), salt)
            if decision is None:
                break
            holder = better_holder(decision, replica_id)
            if holder is not None:
                done += self.transfer(list(prompt), salt, holder.replica_id, replica_id, holder.hit_tokens)
        return done
