"""Replica autoscaling on queue depth, between `min_replicas` and `max_replicas`.

Every `interval_s` the controller looks at the replicas and the requests in flight per replica
and takes the first rule that applies:

    fewer than min_replicas (one died or was purged)   add one (BELOW_MIN)
    more than max_replicas                             remove one, drained first (ABOVE_MAX)
    depth > scale_up_queue_depth, below max            add one, then warm it: the hottest recent
                                                       prefixes are copied onto it from their
                                                       holders (a transfer each), so its first
                                                       requests hit (QUEUE_DEPTH)
    nothing in flight for scale_down_idle_s, above min remove one, drained first: no request is
                                                       cut (IDLE); the idle clock then restarts

At most one action per step, so a burst does not start every replica at once, and no action while
another step's is still in flight (the controller's actor is threaded: its own loop and a front
door's `autoscale_step` can overlap): that step answers NONE / ACTION_IN_FLIGHT at once.

`step()` is the policy, callable directly (tests); `start()` runs it on a daemon thread. The
replicas it drives (`ScalableReplicas`: the controller, or a test double) and the clock are
injected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from cluster.config import AutoscalerConfig

log = logging.getLogger(__name__)





class ScaleAction(str, Enum):
    NONE = "none"
    UP = "up"
    DOWN = "down"


class ScaleReason(str, Enum):
    BELOW_MIN = "below_min"  # UP: a replica died or was purged
    QUEUE_DEPTH = "queue_depth"  # UP
    ABOVE_MAX = "above_max"  # DOWN
    IDLE = "idle"  # DOWN
    STEADY = "steady"  # NONE: no rule applies
    AT_MAX = "at_max"  # NONE: deep queues, but max_replicas already
    ACTION_IN_FLIGHT = "action_in_flight"  # NONE: another step is still adding or removing one


@dataclass(frozen=True)
class ScaleEvent:
    """One step's decision and, for UP/DOWN, what was done."""

    action: ScaleAction
    reason: ScaleReason
    replica_id: str | None = None  # the replica added or removed
    num_replicas: int = 0  # seen before acting
    depth: float = 0.0  # requests in flight per replica, seen before acting
    warmed: int = 0  # prefixes transferred onto a new replica
    seconds: float = 0.0  # the action's duration on the injected clock


class ScalableReplicas(Protocol):
    """What the autoscaler drives: the controller (`ClusterController`), a front door
    (`ClusterBackend`), or a test double. Both actions block until done."""

    @property
    def replica_ids(self) -> list[str]: ...  # live replicas, draining ones included

    @property
    def num_unfinished(self) -> int: ...  # requests in flight, all replicas

    def add_replicas(self, n: int) -> list[str]: ...  # started and serving

    def warm(self, replica_id: str, limit: int | None = None) -> int: ...  # prefixes copied onto it

    def remove_replica(self, replica_id: str) -> None: ...  # drained, then stopped


def decide(config: AutoscalerConfig, num_replicas: int, depth: float,
           idle_for: float | None) -> tuple[ScaleAction, ScaleReason]:
    """The policy, pure. `idle_for`: seconds with nothing in flight (None: something is)."""
    c = config
    if num_replicas < c.min_replicas:
        return ScaleAction.UP, ScaleReason.BELOW_MIN
    if num_replicas > c.max_replicas:
        return ScaleAction.DOWN, ScaleReason.ABOVE_MAX
    if depth > c.scale_up_queue_depth:
        if num_replicas < c.max_replicas:
            return ScaleAction.UP, ScaleReason.QUEUE_DEPTH
        return ScaleAction.NONE, ScaleReason.AT_MAX
    if idle_for is not None and idle_for >= c.scale_down_idle_s and num_replicas > c.min_replicas:
        return ScaleAction.DOWN, ScaleReason.IDLE
    return ScaleAction.NONE, ScaleReason.STEADY


class ReplicaAutoscaler:
    def __init__(self, backend: ScalableReplicas, config: AutoscalerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.config = config
        self.clock = clock
        self._idle_since: float | None = None
        self._acting = threading.Lock()  # held from a step's look to the end of its action
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.history: list[ScaleEvent] = []  # UP and DOWN events, oldest first

    def step(self) -> ScaleEvent:
        """Look once and act at most once; NONE / ACTION_IN_FLIGHT at once if another step acts."""
        if not self._acting.acquire(blocking=False):
            return ScaleEvent(ScaleAction.NONE, ScaleReason.ACTION_IN_FLIGHT)
        try:
            return self._step()
        finally:
            self._acting.release()

    def _step(self) -> ScaleEvent:
        c = self.config
        replicas = self.backend.replica_ids
        inflight = self.backend.num_unfinished
        depth = inflight / max(len(replicas), 1)
        now = self.clock()
        if inflight:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        idle_for = None if self._idle_since is None else now - self._idle_since
        action, reason = decide(c, len(replicas), depth, idle_for)
        if action is ScaleAction.NONE:
            return ScaleEvent(action, reason, None, len(replicas), depth)
        if action is ScaleAction.UP:
            (new,) = self.backend.add_replicas(1)
            warmed = self.backend.warm(new, c.warm_prefixes)
            event = ScaleEvent(action, reason, new, len(replicas), depth, warmed, self.clock() - now)
            log.info("autoscaler: %s (%d replicas, %.1f requests per replica): added %s, warmed %d prefixes "
                     "in %.1f s", reason.value, len(replicas), depth, new, warmed, event.seconds)
        else:
            victim = replicas[-1]
            self.backend.remove_replica(victim)
            self._idle_since = self.clock()  # another full idle period before the next removal
            event = ScaleEvent(action, reason, victim, len(replicas), depth, 0, self.clock() - now)
            log.info("autoscaler: %s (%d replicas): removed %s", reason.value, len(replicas), victim)
        self.history.append(event)
        return event

    def start(self) -> None:
        """Step every `interval_s` on a daemon thread (also with min == max: a dead replica is replaced)."""
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
