"""Replacing dead replicas of a fixed-size cluster (no autoscaler), with a crash-loop backoff.

A cluster started with `num_replicas: N` and no autoscaler keeps N *slots*. A replica that dies,
reports itself unhealthy or stops answering is purged (`ReplicaSet.purge`); its slot becomes
vacant and a replacement is started for it, as Ray Serve and Kubernetes keep a deployment at its
configured count:

    deaths in a row of one slot    1     2        3                   4  ...
    wait before its replacement    0     initial  initial*multiplier  ... up to backoff_max_s

A failed start (no resources, a model that does not load) counts as one more death of the slot.
A replacement that ran `backoff_reset_s` without dying starts the slot's count afresh. A replica
removed on purpose (`remove_replica`: scale-down, an operator) gives its slot up: never replaced.
Replicas added on purpose (`add_replicas`) get slots of their own.

`step()` is the policy, callable directly (tests); `start()` runs it on a daemon thread, woken by
each death. The starter (`start_replica`, the controller's) and the clock are injected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cluster.config import ReplicaRestartConfig

log = logging.getLogger(__name__)

IDLE_WAIT_S = 5.0  # the thread's longest sleep with nothing due (a death wakes it at once)
HISTORY_LEN = 256  # attempts remembered (a crash loop must not grow memory without bound)





@dataclass(frozen=True)
class RestartEvent:
    """One replacement attempt for a slot."""

    slot: int
    replaced: str  # the replica whose death (or whose failed replacement) vacated the slot
    replica_id: str | None  # the replacement (None: its start failed; retried after the backoff)
    num_failures: int  # deaths and failed starts of the slot in a row, this attempt's cause included
    waited_s: float  # from the slot falling vacant to this attempt, on the injected clock
    error: str | None = None


@dataclass
class _Slot:
    index: int
    replica_id: str  # the current replica, or the last one while vacant
    started_at: float  # when that replica came up
    vacant_since: float | None = None
    due_at: float | None = None  # vacant: when its replacement may start
    num_failures: int = 0  # deaths and failed starts in a row
    starting: bool = False  # a replacement is being started


class ReplicaRestarter:
    def __init__(self, start_replica: Callable[[], str], config: ReplicaRestartConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`start_replica()`: start one replica, wait until it serves (registered with the cache
        service, routable), return its id; raises if it cannot."""
        self.start_replica = start_replica
        self.config = config
        self.clock = clock
        self._slots: list[_Slot] = []
        self._next_slot = 0
        self._lock = threading.Lock()  # guards the slots (deaths arrive from any controller thread)
        self._stepping = threading.Lock()  # one step's attempts at a time
        # ids that died before they had a slot (purged while their start was returning): id -> reason
        self._early_deaths: dict[str, str] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.history: deque[RestartEvent] = deque(maxlen=HISTORY_LEN)  # oldest first
        self.num_restarts = 0  # replacements started and serving
        self.num_failed_starts = 0

    # ---- what the controller reports -------------------------------------------------------------
    def track(self, replica_ids: list[str]) -> None:
        """Replicas started on purpose (the initial ones, `add_replicas`): a slot each."""
        now = self.clock()
        with self._lock:
            for rid in replica_ids:
                self._slots.append(_Slot(self._next_slot, rid, now))
                self._next_slot += 1
        for rid in replica_ids:
            self._died_early(rid)

    def _died_early(self, replica_id: str) -> None:
        """`replica_id` just got its slot: if it died before, its slot falls vacant now."""
        with self._lock:
            reason = self._early_deaths.pop(replica_id, None)
        if reason is not None:
            self.replica_failed(replica_id, f"{reason} (while starting)")

    def release(self, replica_id: str) -> bool:
        """`replica_id` is removed on purpose: its slot goes, and nothing replaces it (also if it
        dies while draining). True if it had a slot."""
        with self._lock:
            slot = self._find(replica_id)
            if slot is None or slot.starting:
                return False
            self._slots.remove(slot)
        log.info("replica %s removed on purpose: slot %d given up (%d slots)", replica_id, slot.index,
                 self.num_slots)
        return True

    def replica_failed(self, replica_id: str, reason: str) -> float | None:
        """`replica_id` died or was purged as unhealthy: its slot falls vacant. Returns the wait
        before its replacement (None: no slot, e.g. removed on purpose)."""
        with self._lock:
            slot = self._find(replica_id)
            if slot is None or slot.vacant_since is not None:
                if slot is None:  # maybe its slot is not set yet (ids are never reused)
                    self._early_deaths[replica_id] = reason
                    while len(self._early_deaths) > HISTORY_LEN:
                        del self._early_deaths[next(iter(self._early_deaths))]
                return None
            delay = self._vacate(slot, replica_id, reason)
        self._wake.set()
        return delay

    def _vacate(self, slot: _Slot, replica_id: str, reason: str) -> float:
        now = self.clock()
        if now - slot.started_at >= self.config.backoff_reset_s:
            slot.num_failures = 0  # it ran long enough: not part of a crash loop
        slot.num_failures += 1
        delay = self.config.delay_s(slot.num_failures)
        slot.vacant_since, slot.due_at = now, now + delay
        log.warning("replica %s (slot %d) %s: replacing it in %.1f s (death %d in a row)", replica_id,
                    slot.index, reason, delay, slot.num_failures)
        return delay

    def _find(self, replica_id: str) -> _Slot | None:
        return next((s for s in self._slots if s.replica_id == replica_id), None)

    # ---- views ------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """The replica count this cluster keeps."""
        return len(self._slots)

    def vacant(self) -> list[tuple[int, float]]:
        """(slot, due at) of each vacant slot not being started."""
        with self._lock:
            return [(s.index, s.due_at) for s in self._slots if s.vacant_since is not None and not s.starting]

    # ---- the policy -------------------------------------------------------------------------------
    def step(self) -> list[RestartEvent]:
        """Start a replacement for every vacant slot whose wait is over, one after another (one
        attempt per slot). Returns at once (nothing) while another step is starting replicas."""
        if not self._stepping.acquire(blocking=False):
            return []
        try:
            events: list[RestartEvent] = []
            while not self._stop.is_set() and (slot := self._take_due({e.slot for e in events})) is not None:
                events.append(self._attempt(slot))
            return events
        finally:
            self._stepping.release()

    def _take_due(self, tried: set[int]) -> _Slot | None:
        now = self.clock()
        with self._lock:
            due = [s for s in self._slots if s.vacant_since is not None and not s.starting and s.due_at <= now
                   and s.index not in tried]
            if not due:
                return None
            slot = min(due, key=lambda s: (s.due_at, s.index))
            slot.starting = True
            return slot

    def _attempt(self, slot: _Slot) -> RestartEvent:
        replaced, waited, failures = slot.replica_id, self.clock() - slot.vacant_since, slot.num_failures
        try:
            new = self.start_replica()
        except Exception as exc:  # noqa: BLE001 - a failed start is one more death of the slot
            with self._lock:
                slot.starting = False
                self.num_failed_starts += 1
                slot.started_at = self.clock()  # no credit towards the reset: it never ran
                delay = self._vacate(slot, replaced, f"could not be replaced ({type(exc).__name__}: {exc})")
            event = RestartEvent(slot.index, replaced, None, failures, waited, f"{type(exc).__name__}: {exc}")
            log.warning("slot %d: replacement failed; next try in %.1f s", slot.index, delay)
        else:
            with self._lock:
                slot.starting = False
                slot.replica_id, slot.started_at, slot.vacant_since, slot.due_at = new, self.clock(), None, None
                self.num_restarts += 1
                event = RestartEvent(slot.index, replaced, new, failures, waited)
            log.info("slot %d: %s replaced by %s after %.1f s (restart %d)", slot.index, replaced, new, waited,
                     self.num_restarts)
            self._died_early(new)
        self.history.append(event)
        return event

    # ---- the loop -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Run `step` on a daemon thread: woken by each death, sleeping until the next slot is due."""
        self._thread = threading.Thread(target=self._run, name="replica-restarts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # noqa: BLE001 - keep replacing
                log.exception("replica restart step failed")
            due = [at for _, at in self.vacant()]
            wait = min(due) - self.clock() if due else IDLE_WAIT_S
            self._wake.wait(min(max(wait, 0.01), IDLE_WAIT_S))
            self._wake.clear()

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
