"""Keeps a front door's read replica of the index (`cache_service.index_mirror.IndexMirror`) in step
with the cache service, on a thread of its own:

    no snapshot yet, a restarted service, or behind   -> service.snapshot()          (one call)
    then, in a loop                                   -> service.note_routed(booked)  (no reply awaited)
                                                      -> service.follow(cursor, wait_s) -> apply

`follow` waits on the service for the next op (its own concurrency group), so the mirror hears
of each pushed batch about one Ray hop after the service applied it, and an idle cluster costs
one call per `wait_s`. A service without that group answers at once: the follower then polls
every `poll_s`. Any failure (the service died, a timeout) invalidates the mirror at once, so
the front door routes through the service or by load until a snapshot of the new instance
arrives: it never routes on entries a restarted service no longer vouches for.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from cache_service.index_mirror import IndexMirror

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0


class IndexFollower:
    def __init__(self, get_service, mirror: IndexMirror, wait_s: float = 0.05, poll_s: float = 0.002,
                 retry_s: float = 0.2, on_failure=None) -> None:
        """`get_service()`: the service's actor handle (looked up again after `on_failure()`)."""
        self.get_service = get_service
        self.mirror = mirror
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.on_failure = on_failure
        self.num_snapshots = 0
        self.num_failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="index-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not ray.is_initialized():  # shut down under us: never start Ray again from here
                self.mirror.invalidate()
                self._stop.wait(self.retry_s)
                continue
            try:
                self._follow_once()
            except Exception as exc:  # noqa: BLE001 - dead, restarting, slow: start over from a snapshot
                self.num_failures += 1
                self.mirror.invalidate()
                if self.on_failure is not None:
                    self.on_failure()
                log.debug("index follower: %s; retrying", type(exc).__name__)
                self._stop.wait(self.retry_s)

    def _follow_once(self) -> None:
        service = self.get_service()
        if not self.mirror.ready:
            self.mirror.load(ray.get(service.snapshot.remote(), timeout=CALL_TIMEOUT_S))
            self.num_snapshots += 1
        booked = self.mirror.take_booked()
        if booked:
            service.note_routed.remote(booked)
        t0 = time.monotonic()
        msg = ray.get(service.follow.remote(self.mirror.cursor, self.wait_s), timeout=CALL_TIMEOUT_S)
        if not self.mirror.apply(msg):
            self.mirror.invalidate()  # another instance, or ops it no longer keeps: a snapshot next
        elif not msg.ops and time.monotonic() - t0 < self.wait_s / 2:
            self._stop.wait(self.poll_s)  # it did not wait for an op: poll
