"""The front end's error plumbing: `HttpError` and FastAPI handlers that turn validation and
routing failures into OpenAI-shaped 4xx JSON errors (never a traceback, never a 5xx for bad input)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.http.protocol import error_response


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.response = error_response(status, message, kind, param, headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HttpError)
    async def _http_error(_: Request, exc: HttpError) -> JSONResponse:
        return exc.response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ())[1:]]
        param = loc[0] if loc else None
        if first.get("type") in ("json_invalid", "model_attributes_type") or not loc:
            return error_response(400, "the body must be a JSON object sent as Content-Type: application/json "
                                  f"({first.get('msg', 'invalid JSON')})")
        if param == "prompt" and len(loc) > 1 and first.get("type") not in ("missing",):
            empty = any(e.get("type") in ("string_too_short", "too_short") for e in exc.errors())
            message = "the prompt is empty" if empty else "prompt must be a string or a list of token ids"
            return error_response(400, message, param=param)
        return error_response(400, f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = "the body is not valid UTF-8 JSON" if exc.status_code == 400 else str(exc.detail)
        return error_response(exc.status_code, message, kind, headers=getattr(exc, "headers", None))
