"""Driving one request through the backend for the HTTP front end: submit (mapping backend
errors to HTTP ones), follow its outputs into a `CompletionState`, stop it early when a stop
string matched, and abort it when the client goes away. The engine's lookup report on its
outputs goes to `CacheReports` (the miss counter, `/v1/cache/explain/{id}`)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from cluster.http.backend import Backend
from cluster.http.cache_reports import CacheReports
from cluster.http.errors import HttpError
from cluster.http.metrics import Metrics
from cluster.http.streaming import SseResponse, follow, sse_event, stream_error
from cluster.text.completion_state import CompletionState, Increment
from workers.engine.errors import InvalidRequestError, ServerOverloadedError
from workers.engine.sampling_params import SamplingParams
from workers.engine_runner import RequestStream, StreamEnd

log = logging.getLogger(__name__)


class RequestDriver:
    def __init__(self, backend: Backend, metrics: Metrics, reports: CacheReports) -> None:
        self.backend = backend
        self.metrics = metrics
        self.reports = reports

    async def submit(self, prompt: list[int], params: SamplingParams, cache_salt: str | None,
                     response_id: str | None = None) -> RequestStream:
        """`response_id`: the OpenAI id the response will carry (explain finds the request by it)."""
        stream = await self._submit(prompt, params, cache_salt)
        self.reports.submitted(stream.request_id, response_id, prompt, cache_salt)
        return stream

    async def _submit(self, prompt: list[int], params: SamplingParams, cache_salt: str | None) -> RequestStream:
        if not prompt:
            raise HttpError(400, "the prompt is empty", param="prompt")
        try:  # in a thread: a backend's submit may wait for its engine step to end
            return await asyncio.to_thread(self.backend.submit, prompt, params, cache_salt)
        except InvalidRequestError as exc:
            param = "prompt" if "prompt" in str(exc) or "token" in str(exc) else None
            raise HttpError(400, str(exc), param=param) from None
        except ServerOverloadedError as exc:
            retry = max(1, math.ceil(exc.retry_after_s))
            raise HttpError(429, f"server overloaded: {exc}", "rate_limit_error",
                            headers={"Retry-After": str(retry)}) from None
        except Exception as exc:
            log.exception("backend submit failed")
            raise HttpError(500, f"backend failed: {exc}", "server_error") from None

    def abort(self, stream: RequestStream, status: str | None) -> None:
        """Fire-and-forget (never block, or await in, a cancelled task); `status` None: a normal
        early stop (stop string), not a failure."""
        if status is not None:
            self.metrics.record_failure(status)
        asyncio.get_running_loop().run_in_executor(None, self.backend.abort, stream.request_id)

    async def _updates(self, stream: RequestStream, started_s: float, state: CompletionState):
        """(Increment | StreamEnd) until the state is finished; stops the engine request when
        the state finished first (a stop string). Hands the engine's lookup report to `reports`."""
        reported = None
        async for item in follow(stream, self.metrics, started_s):
            if isinstance(item, StreamEnd):
                yield item
                return
            if item.cache_report is not None and item.cache_report != reported:  # O(groups), once per lookup
                reported = item.cache_report
                self.reports.record(stream.request_id, reported)
            inc = state.update(item)
            yield inc
            if inc.finished:
                if not item.finished:
                    self.abort(stream, None)
                return

    async def run(self, stream: RequestStream, request: Request, started_s: float, state: CompletionState) -> None:
        """Follows the request to its end; aborts it if the client goes away first."""
        async def consume():
            async for item in self._updates(stream, started_s, state):
                if isinstance(item, StreamEnd):
                    return item
            return None

        task = asyncio.ensure_future(consume())
        while not (await asyncio.wait({task}, timeout=0.5))[0]:
            if await request.is_disconnected():
                task.cancel()
                self.abort(stream, "disconnect")
                raise HttpError(499, "client disconnected")
        end = task.result()
        if end is not None:
            error = stream_error(end)
            raise HttpError(error["code"], error["message"], error["type"])

    def sse(self, stream: RequestStream, started_s: float, state: CompletionState,
            chunks: Callable[[Increment], list[dict]]) -> StreamingResponse:
        """SSE over `chunks(increment) -> list[dict]`; ends with `[DONE]`, after an error event if
        the backend failed; aborts the request if the client goes away first."""

        async def events():
            done = False
            try:
                async for item in self._updates(stream, started_s, state):
                    if isinstance(item, StreamEnd):
                        done = True
                        yield sse_event({"error": stream_error(item)})
                        break
                    done = item.finished
                    for chunk in chunks(item):
                        yield sse_event(chunk)
                yield sse_event("[DONE]")
            finally:
                if not done:
                    self.abort(stream, "disconnect")

        return SseResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
