"""Runs an `LLMEngine` on its own thread and streams each request's outputs to its caller.

The engine is single-threaded by design; every call into it goes through the runner's inbox
and is executed between steps, so callers on other threads (the HTTP server, a Ray actor's
methods) never race the step loop. A failed step fails the requests it held with the error,
instead of killing the loop silently. At most `max_queued` requests are in flight (waiting or
running); `submit` beyond that raises `ServerOverloadedError` (HTTP 429) instead of queueing
without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from workers.engine.engine import LLMEngine
from workers.engine.errors import ServerOverloadedError
from workers.engine.request import RequestOutput
from workers.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamEnd:
    error: BaseException | None = None


class RequestStream:
    """Outputs of one request, in order; ends with the finished output (or raises its error)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.Queue[RequestOutput | StreamEnd] = queue.Queue()
        self.on_item: Callable[[], None] | None = None  # e.g. wake an asyncio loop

    def put(self, item: RequestOutput | StreamEnd) -> None:
        self._queue.put(item)
        if self.on_item is not None:
            self.on_item()

    def get(self, timeout: float | None = None) -> RequestOutput | StreamEnd:
        return self._queue.get(timeout=timeout)

    def get_nowait(self) -> RequestOutput | StreamEnd | None:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self.get()
            if isinstance(item, StreamEnd):
                if item.error is not None:
                    raise item.error
                return
            yield item
            if item.finished:
                return


class EngineRunner:
    def __init__(self, engine: LLMEngine, max_queued: int = 256) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.engine = engine
        self.max_queued = max_queued
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        self._ids = 0
        self._lock = threading.Lock()
        self.on_step: Callable[[LLMEngine], None] | None = None  # on the loop after each step (events, load)
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
               request_id: str | None = None) -> RequestStream:
        """Validate and enqueue; raises `InvalidRequestError` at once for bad input and
        `ServerOverloadedError` when `max_queued` requests are already in flight."""
        with self._lock:
            self._ids += 1
            rid = request_id or f"run-{self._ids}"
        stream = RequestStream(rid)

        def add(engine: LLMEngine) -> None:
            if len(self._streams) >= self.max_queued:  # checked on the loop thread: no race
                raise ServerOverloadedError(f"{len(self._streams)} requests in flight (max_queued)", 1.0)
            engine.add_request(prompt_token_ids, params, request_id=rid, cache_salt=cache_salt)
            self._streams[rid] = stream

        self.call(add)
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client went away); its stream ends with a plain `StreamEnd`."""

        def drop() -> None:
            if self.engine.abort(request_id):
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(StreamEnd())

        self._inbox.put(drop)

    def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run `fn(engine)` on the loop thread between steps and return its result."""
        result: list[object] = []
        failure: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(fn(self.engine))
            except BaseException as exc:
                failure.append(exc)
            finally:
                done.set()

        self._inbox.put(run)
        done.wait()
        if failure:
            raise failure[0]
        return result[0]

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                while True:
                    self._inbox.get(block=block, timeout=0.5 if block else None)()
                    block = False
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                self._after_step()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # fail the requests, keep serving
                log.exception("engine step failed")
                for rid in list(self._streams):
                    self.engine.abort(rid)
                    self._streams.pop(rid).put(StreamEnd(exc))
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]
            self._after_step()

    def _after_step(self) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.engine)
            except Exception:  # noqa: BLE001 - publishing must never stop serving
                log.exception("on_step hook failed")
