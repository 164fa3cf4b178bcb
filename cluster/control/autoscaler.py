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

With `cluster.pd` each role (prefill, decode) is scaled by the same rules within its own bounds,
on its own replicas and requests (`control.scale_policy.decide_roles`: still one action per step,
BELOW_MIN first, then the role with the stronger signal). A replica added for a role is started
as one (`add_replicas(1, role=...)`); only a prefill replica is warmed (a decode replica never
prefills: it imports each request's pages with its hand-off); a removal takes the last replica of
the role scaled down, drained first. Each role has its own idle clock.

`step()` is the policy, callable directly (tests); `start()` runs it on a daemon thread. The
replicas it drives (`ScalableReplicas`, with pd `RoleScalableReplicas`: the controller, or a test
double) and the clock are injected. The rules themselves are pure (`control.scale_policy`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from cluster.config import AutoscalerConfig
from cluster.control.replica_roles import RoleLoad
from cluster.control.scale_policy import (
    RoleSignal,
    ScaleAction,
    ScaleEvent,
    ScaleReason,
    decide,
    decide_roles,
)
from cluster.pd_config import PREFILL, ROLES

__all__ = ["ReplicaAutoscaler", "RoleScalableReplicas", "ScalableReplicas", "ScaleAction", "ScaleEvent",
           "ScaleReason", "decide"]

log = logging.getLogger(__name__)


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


class RoleScalableReplicas(ScalableReplicas, Protocol):
    """What the autoscaler drives with `cluster.pd`: the controller, or a test double."""

    def role_loads(self) -> dict[str, RoleLoad]: ...  # PREFILL and DECODE -> the role's replicas, requests

    def add_replicas(self, n: int, role: str | None = None) -> list[str]: ...  # started as `role`


class ReplicaAutoscaler:
    def __init__(self, backend: ScalableReplicas, config: AutoscalerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.config = config
        self.clock = clock
        self._idle_since: float | None = None
        self._role_idle_since: dict[str, float | None] = dict.fromkeys(ROLES)  # with pd: each role's
        self._acting = threading.Lock()  # held from a step's look to the end of its action
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.history: list[ScaleEvent] = []  # UP and DOWN events, oldest first

    def step(self) -> ScaleEvent:
        """Look once and act at most once; NONE / ACTION_IN_FLIGHT at once if another step acts."""
        if not self._acting.acquire(blocking=False):
            return ScaleEvent(ScaleAction.NONE, ScaleReason.ACTION_IN_FLIGHT)
        try:
            return self._step_roles() if self.config.pd.enabled else self._step()
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

    def _step_roles(self) -> ScaleEvent:
        """`_step` with `cluster.pd`: each role's signal, one role acted on (`decide_roles`)."""
        c = self.config
        loads = self.backend.role_loads()
        now = self.clock()
        signals = []
        for role in ROLES:
            load = loads[role]
            if load.num_unfinished:
                self._role_idle_since[role] = None
            elif self._role_idle_since[role] is None:
                self._role_idle_since[role] = now
            since = self._role_idle_since[role]
            n = len(load.replica_ids)
            signals.append(RoleSignal(role, n, load.num_unfinished / max(n, 1), None if since is None else now - since,
                                      *c.pd.bounds(role)))
        s, action, reason = decide_roles(c, signals)
        if action is ScaleAction.NONE:
            return ScaleEvent(action, reason, None, s.num_replicas, s.depth, role=s.role)
        if action is ScaleAction.UP:
            (new,) = self.backend.add_replicas(1, role=s.role)
            warmed = self.backend.warm(new, c.warm_prefixes) if s.role == PREFILL else 0
            event = ScaleEvent(action, reason, new, s.num_replicas, s.depth, warmed, self.clock() - now, s.role)
            log.info("autoscaler: %s of %s (%d replicas, %.1f requests per replica): added %s, warmed %d "
                     "prefixes in %.1f s", reason.value, s.role, s.num_replicas, s.depth, new, warmed, event.seconds)
        else:
            victim = loads[s.role].replica_ids[-1]
            self.backend.remove_replica(victim)
            self._role_idle_since[s.role] = self.clock()  # another full idle period before the role's next removal
            event = ScaleEvent(action, reason, victim, s.num_replicas, s.depth, 0, self.clock() - now, s.role)
            log.info("autoscaler: %s of %s (%d replicas): removed %s", reason.value, s.role, s.num_replicas, victim)
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
