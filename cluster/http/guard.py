"""ASGI middleware in front of every route: API key on `/v1/*`, the body size limit, and a
response counter by route and status code.

The body is read here, up to `max_body_bytes` (413 beyond, or at once when Content-Length says
so), and replayed to the app, so no handler ever sees an oversized body. Runs as plain ASGI (not
`BaseHTTPMiddleware`) so streaming responses and disconnect detection pass through untouched.
"""

from __future__ import annotations

import json
import secrets

from cluster.http.metrics import Metrics


def _error_bytes(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


class HttpGuard:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, metrics: Metrics,
                 routes: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.routes else "other"  # bounded label set

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.record_response(route, message["status"])
            await send(message)

        async def reject(status: int, message: str, kind: str = "invalid_request_error") -> None:
            body = _error_bytes(status, message, kind)
            await counted_send({"type": "http.response.start", "status": status,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
            await counted_send({"type": "http.response.body", "body": body})

        headers = dict(scope["headers"])
        if self.expected and path.startswith("/v1/"):
            if not secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
                await reject(401, "missing or invalid API key", "authentication_error")
                return
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await reject(400, "invalid Content-Length header")
                return
            if int(declared) > self.max_body_bytes:
                await reject(413, f"request body of {int(declared)} bytes is over the {self.max_body_bytes}-byte limit")
                return
        chunks, num_bytes = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_body_bytes:
                await reject(413, f"request body is over the {self.max_body_bytes}-byte limit")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later calls: disconnect detection
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, counted_send)
