"""Following a backend `RequestStream` from asyncio, and the pieces of an SSE response.

`follow` wakes on the backend thread's `on_item` callback instead of polling, and records the
request's latencies and outcome in `Metrics` as its items pass.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from cluster.http.metrics import Metrics
from cluster.http.protocol import SamplingFields
from cluster.text.completion_state import CompletionState
from workers.engine.request import RequestOutput
from workers.engine_runner import RequestStream, StreamEnd


class SseResponse(StreamingResponse):
    """Closes its generator when the client goes away, so the request is aborted at once."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def sse_event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def with_usage(body: SamplingFields, state: CompletionState, head: dict, events: list[dict],
               finished: bool) -> list[dict]:
    """A step's SSE chunks (`head` + choices) with usage as OpenAI and vLLM send it, for both endpoints:
    on every chunk under `continuous_usage_stats`, and with `include_usage` one last chunk of no choices."""
    if body.continuous_usage:
        events = [{**e, "usage": state.usage()} for e in events]
    if finished and body.include_usage:
        events.append({**head, "choices": [], "usage": state.usage()})
    return events


def stream_error(item: StreamEnd) -> dict:
    """The OpenAI-shaped error for a stream that ended without a finished output: 400 for a
    request the backend refused late, 503 (retryable) when no replica could finish it, else 500."""
    from workers.engine.errors import InvalidRequestError, ServerOverloadedError

    if item.error is None:
        return {"message": "request aborted", "type": "server_error", "param": None, "code": 503}
    if isinstance(item.error, InvalidRequestError):
        return {"message": str(item.error), "type": "invalid_request_error", "param": None, "code": 400}
    if isinstance(item.error, ServerOverloadedError):
        return {"message": f"{item.error} (retry)", "type": "server_error", "param": None, "code": 503}
    return {"message": f"backend failed: {item.error}", "type": "server_error", "param": None, "code": 500}


async def follow(stream: RequestStream, metrics: Metrics,
                  started_s: float) -> AsyncIterator[RequestOutput | StreamEnd]:
    """The stream's items as they arrive, ending after a finished output or a `StreamEnd`;
    records TTFT, inter-token latency and the request's outcome."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def notify() -> None:  # runs on the backend's thread
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    stream.on_item = notify
    last_token_s = None
    while True:
        item = stream.get_nowait()
        if item is None:
            await wake.wait()
            wake.clear()
            continue
        if isinstance(item, StreamEnd):
            metrics.record_failure("error" if item.error is not None else "abort")
            yield item
            return
        now = time.perf_counter()
        if item.new_token_ids:
            if last_token_s is not None:
                metrics.observe_itl(now - last_token_s, len(item.new_token_ids))
            last_token_s = now
        if item.finished:
            metrics.record(item, now - started_s)
        yield item
        if item.finished:
            return


async def last_item(items: AsyncIterator):
    last = None
    async for item in items:
        last = item
    return last
