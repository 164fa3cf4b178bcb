"""Move a hit's pages or recompute them: decided by the link speed and prefill speed measured.

A planned transfer (`transfer_plan.plan_transfer`) is worth doing only when copying the pages
over the link between the two hosts is faster than the target prefilling those tokens itself:

    transfer_s = bytes / (measured bytes/s of the host pair)       bytes = the replica's page model
    recompute_s = tokens / (measured prefill tokens/s of the target)
    move iff transfer_s < recompute_s

Both speeds are measured from the work itself: each finished transfer (bytes, seconds, source
and target host) and each finished request (prompt tokens computed, time to first token),
averaged as time per byte or token (`smoothing`: the newest sample's weight). A pair
or replica never measured gets the assumed speed in `LinkCostConfig`; a pair's measurement older
than `remeasure_after_s` while transfers are being skipped gets one trial transfer (a link that
was slow may be fast again), so a skipped pair is never skipped forever on one old sample.
Pure policy, no Ray: `cluster/frontdoor/backend.py` feeds it and asks it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkCostConfig:
    """Assumptions for what was never measured, and how fast measurements follow change
    (YAML: `router.links`)."""

    assumed_link_gbps: float = 10.0  # a host pair no transfer has crossed yet (same host: local copy)
    assumed_prefill_tokens_per_s: float = 2000.0  # a replica that has not prefilled yet
    smoothing: float = 0.5  # weight of the newest sample in each moving average
    remeasure_after_s: float = 60.0  # a pair skipped on a sample this old gets one trial transfer

    def __post_init__(self) -> None:
        if not self.assumed_link_gbps > 0 or not self.assumed_prefill_tokens_per_s > 0:
            raise ValueError("assumed_link_gbps and assumed_prefill_tokens_per_s must be > 0")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if not self.remeasure_after_s > 0:
            raise ValueError(f"remeasure_after_s must be > 0, got {self.remeasure_after_s}")


@dataclass(frozen=True)
class PageBytes:
    """The bytes a transfer of an n-token hit moves: `fixed` (the Mamba state pages, one per
    group) + n x `per_token` (attention pages); an upper bound for sliding-window groups."""

    fixed: int
    per_token: float

    def of(self, num_tokens: int) -> int:
        return int(self.fixed + self.per_token * num_tokens)


@dataclass(frozen=True)
class LinkChoice:
    """One transfer-or-recompute decision and what it was made on (`measured`: the link speed
    came from a transfer, not the assumption; `trial`: moved to measure a stale pair again)."""

    move: bool
    transfer_s: float
    recompute_s: float
    link_bytes_per_s: float
    measured: bool
    trial: bool = False


class LinkCosts:
    """Measured speeds per host pair and per replica, and the decision made on them (thread-safe:
    every request thread of a front door reports and asks)."""

    def __init__(self, config: LinkCostConfig = LinkCostConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._links: dict[tuple[str, str], tuple[float, float]] = {}  # pair -> (bytes/s, measured at)
        self._prefill: dict[str, float] = {}  # replica -> prefill tokens/s
        self._trial_at: dict[tuple[str, str], float] = {}  # pair -> when its last trial was granted

    def observe_transfer(self, src_host: str, dst_host: str, num_bytes: int, seconds: float) -> None:
        """A finished transfer: `num_bytes` moved src -> dst in `seconds` (ignored when empty)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        sample = num_bytes / seconds
        with self._lock:
            old = self._links.get((src_host, dst_host))
            rate = sample if old is None else self._blend(old[0], sample)
            self._links[(src_host, dst_host)] = (rate, self._clock())

    def observe_prefill(self, replica_id: str, num_tokens: int, seconds: float | None) -> None:
        """A finished request: `num_tokens` prompt tokens computed before its first token, which
        came `seconds` after it arrived (queueing included: the speed a new request would see)."""
        if num_tokens <= 0 or not seconds or seconds <= 0:
            return
        sample = num_tokens / seconds
        with self._lock:
            old = self._prefill.get(replica_id)
            self._prefill[replica_id] = sample if old is None else self._blend(old, sample)

    def forget_replica(self, replica_id: str) -> None:
        with self._lock:
            self._prefill.pop(replica_id, None)

    def link_speed(self, src_host: str, dst_host: str) -> tuple[float, float | None]:
        """(bytes/s, measured at) of the pair; the assumption and None when never measured."""
        with self._lock:
            known = self._links.get((src_host, dst_host))
        if known is None:
            return self.config.assumed_link_gbps * 1e9 / 8, None
        return known

    def prefill_speed(self, replica_id: str) -> float:
        with self._lock:
            return self._prefill.get(replica_id, self.config.assumed_prefill_tokens_per_s)

    def choose(self, src_host: str, dst_host: str, dst_replica: str, num_tokens: int,
               num_bytes: int) -> LinkChoice:
        """Move `num_bytes` (an n-token hit) src -> dst, or let `dst_replica` recompute?"""
        rate, measured_at = self.link_speed(src_host, dst_host)
        transfer_s = num_bytes / rate
        recompute_s = num_tokens / self.prefill_speed(dst_replica)
        move = transfer_s < recompute_s
        trial = False
        if not move and measured_at is not None:
            now = self._clock()
            with self._lock:
                last = max(measured_at, self._trial_at.get((src_host, dst_host), measured_at))
                if now - last >= self.config.remeasure_after_s:
                    self._trial_at[(src_host, dst_host)] = now
                    move = trial = True
        return LinkChoice(move, transfer_s, recompute_s, rate, measured_at is not None, trial)

    def snapshot(self) -> dict:
        """What `/stats` shows: each pair's bytes/s, each replica's prefill tokens/s."""
        with self._lock:
            return {"links": {f"{s}->{d}": round(r) for (s, d), (r, _) in self._links.items()},
                    "prefill_tokens_per_s": {r: round(v, 1) for r, v in self._prefill.items()}}

    def _blend(self, old: float, sample: float) -> float:
        """Averaged as time per unit (bytes, tokens), not as speed: one fast sample cannot hide
        a link that has become slow (a speed average would stay near the fast one)."""
        a = self.config.smoothing
        return 1.0 / (a / sample + (1 - a) / old)
