"""`/health`, `/version`, `/metrics` (Prometheus), `/v1/models[/{id}]`."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest

from cluster.http.api import VERSION, Api
from cluster.http.errors import HttpError
from cluster.http.protocol import error_docs


def info_routes(api: Api) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict:
        return {"status": "ok", "num_unfinished": api.backend.num_unfinished}

    @router.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @router.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(api.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": api.model_name, "object": "model", "created": api.created, "owned_by": "hybridserve",
                "root": api.model_root or api.model_name, "parent": None, "max_model_len": api.max_model_len}

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}", responses=error_docs(401, 404))
    async def model(model_id: str) -> dict:
        if model_id != api.model_name:
            raise HttpError(404, f"model {model_id!r} not found; this server has {api.model_name!r}",
                            "not_found_error", "model")
        return model_card()

    return router
