"""Pushes one replica's cache events and load to the cache service, once per engine step.

    engine loop: step -> `on_step(load)` (records the load, wakes the publisher; never blocks)
    publisher thread: take every event not yet sent as one packed batch (`EventBatchMsg`, a
        sequence range) -> `service.ingest` -> reply
        accepted          next batch
        refused / lost    chunked resync: a snapshot taken on the engine loop (pending events
                          discarded there: the snapshot holds them), sent in chunks of
                          `chunk_size` keys; the service routes this replica by load meanwhile
        service down      keep the events coming locally; when a service answers again, resync

At most one push is in flight, so batches arrive in order and a slow service makes batches
bigger, not more numerous. A heartbeat push (`heartbeat_s`) carries the load when idle.
The service is found by its Ray actor name, again after every failure (it may be restarted).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import NamedTuple

from cache_service.events import EventSink
from cache_service.messages import EventBatchMsg, IngestReplyMsg, LoadReportMsg, ResyncChunkMsg

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 10.0


class CacheSnapshot(NamedTuple):
    """What a replica holds when its next event is `next_seq`: per group, its device keys and its
    host tier's keys (none without a host tier)."""

    contents: Sequence[Sequence[bytes]]
    next_seq: int
    host: Sequence[Sequence[bytes]] = ()


class EventPublisher:
    def __init__(self, replica_id: str, sink: EventSink, snapshot: Callable[[], CacheSnapshot],
                 service_name: str | None = None, namespace: str | None = None, heartbeat_s: float = 0.5,
                 chunk_size: int = 65536) -> None:
        """`snapshot()` runs on the engine loop: a `CacheSnapshot`, with the sink's pending events
        discarded (they are in the snapshot)."""
        self.replica_id = replica_id
        self.sink = sink
        self.snapshot = snapshot
        self.service_name = service_name
        self.namespace = namespace
        self.heartbeat_s = heartbeat_s
        self.chunk_size = chunk_size
        self.load = LoadReportMsg()
        self.num_pushes = 0
        self.num_resyncs = 0
        self.epoch: str | None = None  # the service instance last heard from
        self._service = None
        self._needs_resync = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, service_name: str, namespace: str | None = None) -> None:
        self.service_name, self.namespace, self._service = service_name, namespace, None
        self.start()

    def start(self) -> None:
        if self._thread is None and self.service_name:
            self._thread = threading.Thread(target=self._run, name="event-publisher", daemon=True)
            self._thread.start()

    def on_step(self, load: LoadReportMsg | None = None) -> None:
        """Called by the engine loop after each step: cheap, never blocks."""
        if load is not None:
            self.load = load
        self._wake.set()

    def request_resync(self) -> None:
        self._needs_resync = True
        self._wake.set()

    @property
    def in_sync(self) -> bool:
        """The service accepted this replica's last push or resync."""
        return self.epoch is not None and not self._needs_resync

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # ---- the publisher thread -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.push_once()
            except Exception as exc:  # noqa: BLE001 - the service is down or restarting: resync later
                self._service, self._needs_resync = None, True
                log.debug("%s: push failed (%s)", self.replica_id, type(exc).__name__)
                self._stop.wait(0.2)

    def push_once(self) -> None:
        if self._needs_resync:
            self.resync()
            return
        first, end, records = self.sink.take_batch()
        batch = self.transform(EventBatchMsg(self.replica_id, first, end, records, self.load))
        if batch is None:
            return
        reply = self._call("ingest", batch)
        self.num_pushes += 1
        if not reply.accepted:
            self.resync()

    def transform(self, batch: EventBatchMsg) -> EventBatchMsg | None:
        """The batch as sent (None: not sent). A seam for test doubles that lose or reorder batches."""
        return batch

    def resync(self) -> None:
        """Send the whole cache in chunks; on any failure the next push starts over."""
        self._needs_resync = True
        contents, next_seq, host = self.snapshot()
        resync_id = uuid.uuid4().hex
        pieces = [(g, keys[i: i + self.chunk_size], False) for g, keys in enumerate(contents)
                  for i in range(0, max(len(keys), 1), self.chunk_size)]
        pieces += [(g, keys[i: i + self.chunk_size], True) for g, keys in enumerate(host)
                   for i in range(0, len(keys), self.chunk_size)]
        for n, (g, keys, on_host) in enumerate(pieces):
            reply = self._call("resync_chunk", ResyncChunkMsg(self.replica_id, resync_id, g, tuple(keys), next_seq,
                                                              first=n == 0, last=n == len(pieces) - 1,
                                                              host=on_host))
            if not reply.accepted:
                raise RuntimeError(f"resync {resync_id} refused (service restarted?)")
        self._needs_resync = False
        self.num_resyncs += 1
        log.info("%s: resynced %d entries (%d on the host tier) into the cache service", self.replica_id,
                 sum(map(len, contents)), sum(map(len, host)))

    def _call(self, method: str, msg) -> IngestReplyMsg:
        reply = self.call_service(method, msg)
        self.epoch = reply.service_epoch
        return reply

    def call_service(self, method: str, msg) -> IngestReplyMsg:
        """One call to the named cache-service actor (a seam: unit tests call a service in process)."""
        import ray

        if self._service is None:
            self._service = ray.get_actor(self.service_name, namespace=self.namespace)
        return ray.get(getattr(self._service, method).remote(msg), timeout=PUSH_TIMEOUT_S)
