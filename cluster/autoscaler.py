"""Replica autoscaling on queue depth, between `min_replicas` and `max_replicas`.

Every `interval_s` the controller looks at the requests in flight per replica:

    depth > scale_up_queue_depth            add one replica, then warm it: the hottest recent
                                            prefixes are copied onto it from their holders
                                            (a transfer each), so its first requests hit
    nothing in flight for scale_down_idle_s remove one replica (drained first: no request is cut)

One action per tick, so a burst does not start every replica at once. `step()` is the policy,
callable directly (tests); `start()` runs it on a daemon thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscalerConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    scale_up_queue_depth: float = 4.0
    scale_down_idle_s: float = 60.0
    interval_s: float = 1.0
    warm_prefixes: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("autoscaler: need 1 <= min_replicas <= max_replicas")
        if self.scale_up_queue_depth <= 0 or self.scale_down_idle_s < 0 or self.interval_s <= 0:
            raise ValueError("autoscaler: thresholds must be positive")


class ScaleAction(str, Enum):
    NONE = "none"
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True)
class ScaleEvent:
    action: ScaleAction
    replica_id: str | None = None
    depth: float = 0.0
    warmed: int = 0  # prefixes transferred onto a new replica
    seconds: float = 0.0


class ReplicaAutoscaler:
    def __init__(self, backend, config: AutoscalerConfig, clock=time.monotonic) -> None:
        self.backend = backend
        self.config = config
        self.clock = clock
        self._idle_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.history: list[ScaleEvent] = []

    def step(self) -> ScaleEvent:
        """Look once and act at most once."""
        c = self.config
        replicas = self.backend.replica_ids
        inflight = self.backend.num_unfinished
        depth = inflight / max(len(replicas), 1)
        now = self.clock()
        if inflight:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        if depth > c.scale_up_queue_depth and len(replicas) < c.max_replicas:
            t0 = time.perf_counter()
            (new,) = self.backend.add_replicas(1)
            warmed = self.backend.warm(new, c.warm_prefixes)
            event = ScaleEvent(ScaleAction.UP, new, depth, warmed, time.perf_counter() - t0)
            log.info("autoscaler: queue depth %.1f per replica > %.1f: added %s (warmed %d prefixes in %.1f s)",
                     depth, c.scale_up_queue_depth, new, warmed, event.seconds)
        elif (self._idle_since is not None and now - self._idle_since >= c.scale_down_idle_s
              and len(replicas) > c.min_replicas):
            victim = replicas[-1]
            t0 = time.perf_counter()
            self.backend.remove_replica(victim)
            self._idle_since = now  # another full idle period before the next removal
            event = ScaleEvent(ScaleAction.DOWN, victim, depth, 0, time.perf_counter() - t0)
            log.info("autoscaler: idle for %.0f s: removed %s", c.scale_down_idle_s, victim)
        else:
            return ScaleEvent(ScaleAction.NONE, None, depth)
        self.history.append(event)
        return event

    def start(self) -> None:
        if self.config.min_replicas == self.config.max_replicas:
            return  # nothing to scale
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a failed scale action must not stop serving
                log.exception("autoscaler step failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
