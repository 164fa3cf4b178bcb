"""Runs an `LLMEngine` on its own thread and streams each request's outputs to its caller.

The engine is single-threaded by design; every call into it goes through the runner's inbox
and is executed between steps, so callers on other threads (the HTTP server, a Ray actor's
methods) never race the step loop. At most `max_queued` requests are in flight (waiting or
running); `submit` beyond that raises `ServerOverloadedError` (HTTP 429) instead of queueing
without bound.

Supervision:
    inbox items     each one wrapped: its exception goes to its caller (or the log), never
                    into the loop
    a step raises   the engine's state is suspect: the loop stops for good (`dead` is set),
                    every stream ends with `EngineDeadError` and every queued call fails with it;
                    `health()` says why from then on, so a replica reports itself unhealthy and
                    the cluster retries its requests elsewhere
    heartbeat       the loop beats after every step and every idle wait; `health()` also reports
                    a loop whose last beat is older than `stall_timeout_s` while it has work
    deadlines       `call` waits at most `call_timeout_s`; it and stream readers (`next_output`)
                    wake at once when the loop dies
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from cache_service import cacheability
from cache_service.block_hash import BlockHash
from cache_service.ids import new_request_id
from workers.engine.engine import LLMEngine
from workers.engine.errors import EngineDeadError, EngineTimeoutError, ServerOverloadedError
from workers.engine.request import RequestOutput
from workers.engine.sampling_params import SamplingParams

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
    def __init__(self, engine: LLMEngine, max_queued: int = 256, call_timeout_s: float = 120.0,
                 stall_timeout_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the heartbeat's clock (tests inject one)."""
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.engine = engine
        self.max_queued = max_queued
        self.call_timeout_s = call_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self.last_beat = clock()
        self.num_steps = 0
        self.dead = threading.Event()  # set once, when the loop stops for good
        self.death: str | None = None
        self._in_step = False
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._hand_offs: dict[str, Callable[[object], None]] = {}  # request id -> its hand-off (`submit`)
        self._stop = threading.Event()
        self.on_step: Callable[[LLMEngine], None] | None = None  # on the loop after each step (events, load)
        self._thread = threading.Thread(target=self._supervised_loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def health(self) -> str | None:
        """None while the loop serves; else why not (it died, or its heartbeat is stale mid-step)."""
        if self.death is not None:
            return self.death
        if not self._thread.is_alive() and not self._stop.is_set():
            return "engine loop exited"
        age = self._clock() - self.last_beat
        if self._in_step and age > self.stall_timeout_s:
            return f"engine loop stalled: no heartbeat for {age:.1f} s"
        return None

    @property
    def cache_profile(self) -> cacheability.CacheProfile:
        """The engine's cacheability: hit grid, shortest prompt that can hit, what each group needs."""
        cache = self.engine.cache
        return cacheability.cache_profile(cache.coordinator, cache.planner.policy,
                                          self.engine.config.enable_prefix_caching)

    def engine_stats(self) -> dict[str, int]:
        """The engine's counters and gauges (read without the loop: plain ints)."""
        return {**self.engine.stats(), "num_steps": self.num_steps}

    def attach_metrics(self, metrics) -> None:
        """The HTTP front end's `Metrics` (the `Backend` protocol): it reads the engine's counters."""
        metrics.attach_engine_stats(self.engine_stats)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
               request_id: str | None = None, block_hashes: Sequence[BlockHash] | None = None,
               hand_off: Callable[[object], None] | None = None) -> RequestStream:
        """Validate and enqueue; raises `InvalidRequestError` at once for bad input and
        `ServerOverloadedError` when `max_queued` requests are already in flight. `block_hashes`:
        the prompt's, when a front door already hashed it. `hand_off` (prefill/decode
        disaggregation): right after the step that emits the request's first token (and before
        the next), the request is exported (`LLMEngine.export_request`), its stream ends after that
        output, and `hand_off(handoff)` is called on the loop thread; a request finished by that
        step just finishes."""
        rid = request_id or new_request_id()
        stream = RequestStream(rid)

        def add(engine: LLMEngine) -> None:
            if len(self._streams) >= self.max_queued:  # checked on the loop thread: no race
                raise ServerOverloadedError(f"{len(self._streams)} requests in flight (max_queued)", 1.0)
            engine.add_request(prompt_token_ids, params, request_id=rid, cache_salt=cache_salt,
                               block_hashes=block_hashes)
            self._streams[rid] = stream
            if hand_off is not None:
                self._hand_offs[rid] = hand_off

        self.call(add)
        return stream

    def adopt_stream(self, request_id: str) -> RequestStream:
        """A stream for a request imported into the engine (`LLMEngine.import_request`): its
        outputs from the next step on. On the loop thread only (inside `call`)."""
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client went away); its stream ends with a plain `StreamEnd`."""

        def drop() -> None:
            self._hand_offs.pop(request_id, None)
            if self.engine.abort(request_id):
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(StreamEnd())

        self._inbox.put(drop)

    def call(self, fn: Callable[[LLMEngine], object], timeout_s: float | None = None) -> object:
        """Run `fn(engine)` on the loop thread between steps and return its result. Raises
        `EngineDeadError` if the loop is (or dies while this waits) and `EngineTimeoutError`
        after `timeout_s` (default `call_timeout_s`)."""
        self._raise_if_dead()
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
        deadline = self._clock() + (self.call_timeout_s if timeout_s is None else timeout_s)
        while not done.wait(0.05):
            self._raise_if_dead()
            if self._clock() > deadline:
                raise EngineTimeoutError(f"engine call did not complete in {timeout_s or self.call_timeout_s} s")
        if failure:
            raise failure[0]
        return result[0]

    def _raise_if_dead(self) -> None:
        if self.death is not None:
            raise EngineDeadError(self.death)

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)
        self._thread.join(timeout=30)

    def _beat(self) -> None:
        self.last_beat = self._clock()

    def _supervised_loop(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - whatever stopped the loop, nobody waits forever
            log.exception("engine loop died")
            self._die(f"engine loop died: {type(exc).__name__}: {str(exc)[:200]}")

    def _die(self, reason: str) -> None:
        self.death = reason
        self.dead.set()
        error = EngineDeadError(reason)
        self._hand_offs.clear()
        for rid in list(self._streams):
            self._streams.pop(rid).put(StreamEnd(error))
        while True:  # queued calls: each fails at once (call() sees `death`); run none of them
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break

    def _run_item(self, item: Callable[[], None]) -> None:
        try:
            item()
        except Exception:  # noqa: BLE001 - an inbox item never stops the loop
            log.exception("engine inbox item failed")

    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                while True:
                    self._run_item(self._inbox.get(block=block, timeout=0.5 if block else None))
                    block = False
            except queue.Empty:
                pass
            self._beat()
            if not self.engine.has_unfinished():
                self._after_step()
                continue
            self._in_step = True
            outputs = self.engine.step()  # raising: `_supervised_loop` declares the loop dead
            self._in_step = False
            self.num_steps += 1
            self._beat()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]
                    self._hand_offs.pop(out.request_id, None)
                elif out.new_token_ids and out.request_id in self._hand_offs:
                    self._export(out.request_id)
            self._after_step()

    def _export(self, request_id: str) -> None:
        """Hand off a request that has just emitted its first token (`submit`'s `hand_off`)."""
        hand_off = self._hand_offs.pop(request_id)
        stream = self._streams.pop(request_id)
        try:
            handoff = self.engine.export_request(request_id)
        except Exception as exc:  # noqa: BLE001 - the request ends with the error; the loop serves on
            log.exception("export of %s failed", request_id)
            stream.put(StreamEnd(exc))
            return
        hand_off(handoff)
        stream.put(StreamEnd())

    def _after_step(self) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.engine)
            except Exception:  # noqa: BLE001 - publishing must never stop serving
                log.exception("on_step hook failed")
