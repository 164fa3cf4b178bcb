"""`GET /v1/cache/explain/{request_id}`: `hybridserve explain` for a request this front end served,
by the OpenAI response id it returned (`cmpl-...`, `chatcmpl-...`) or its internal request id
(`req-...`, the `request_id` field of the answer). Under `/v1/`: with an API key set, it needs the
key like every other `/v1/` route (there is no separate admin key). 404 for an id it does not
hold: unknown, not admitted yet, or older than the last `http.max_explained_requests`."""

from __future__ import annotations

from fastapi import APIRouter

from cluster.http.cache_reports import CacheReports
from cluster.http.errors import HttpError
from cluster.http.protocol import error_docs


def cache_routes(reports: CacheReports) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/cache/explain/{request_id}", responses=error_docs(401, 404))
    async def explain(request_id: str) -> dict:
        body = reports.explain(request_id)
        if body is None:
            raise HttpError(404, f"no prefix-cache lookup held for request {request_id!r}: unknown, not admitted "
                            f"yet, or older than the last {reports.capacity} requests", "not_found_error",
                            "request_id")
        return body

    return router
