"""OpenAI-compatible HTTP front end (FastAPI): `/v1/completions`, `/v1/chat/completions` (SSE
streaming or not), `/v1/models[/{id}]`, vLLM's `/tokenize`, `/detokenize`, `/version`,
`/health`, `/metrics` (Prometheus), `/v1/cache/explain/{request_id}` (why a served request hit what
it hit, `routes_cache.py`).

The backend is a `cluster.http.backend.Backend`: an `EngineRunner` for one engine, or a front
door onto the Ray cluster. Routes by group: `routes_info.py` (health, version, metrics, models),
`routes_tokens.py`, `routes_completions.py`, `routes_chat.py`; what they share is `api.Api`;
`routes_cache.py` reads `cache_reports.CacheReports`, which the request driver feeds.

Bad input is always a 4xx JSON error in OpenAI's shape (`{"error": {"message", "type", "param",
"code"}}`), never a 5xx: 400 invalid or unsupported (naming the field), 401 API key, 404 unknown
model or route, 405, 413 body too large, 429 overloaded (with Retry-After). A backend failure is
a 500 JSON error, or, once a stream has started, an SSE `error` event followed by `[DONE]`.
"""

from __future__ import annotations

from fastapi import FastAPI

from cache_service.cacheability import CacheProfile
from cluster.http.api import VERSION, Api
from cluster.http.backend import Backend
from cluster.http.cache_reports import DEFAULT_CAPACITY, CacheReports
from cluster.http.errors import HttpError, install_error_handlers
from cluster.http.guard import HttpGuard
from cluster.http.metrics import Metrics
from cluster.http.request_driver import RequestDriver
from cluster.http.routes_cache import cache_routes
from cluster.http.routes_chat import chat_routes
from cluster.http.routes_completions import completion_routes
from cluster.http.routes_info import info_routes
from cluster.http.routes_tokens import token_routes
from cluster.text.chat import DEFAULT_TEMPLATE, ChatTemplate
from cluster.text.text_model import GenerationDefaults, TextModel
from cluster.text.tokenizer import ByteTokenizer, Tokenizer

ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                    "/tokenize", "/detokenize", "/version"})
__all__ = ["HttpError", "ROUTES", "VERSION", "create_app"]


def default_text_model(tokenizer: Tokenizer | None) -> TextModel:
    template = ChatTemplate(DEFAULT_TEMPLATE, origin="built-in") if isinstance(tokenizer, ByteTokenizer) else None
    return TextModel(tokenizer, template, GenerationDefaults())


def create_app(backend: Backend, model_name: str, api_key: str | None = None, tokenizer: Tokenizer | None = None,
               max_body_bytes: int = 4 * 2**20, text: TextModel | None = None,
               model_root: str | None = None, cache_profile: CacheProfile | None = None,
               max_explained_requests: int = DEFAULT_CAPACITY) -> FastAPI:
    """`text` (tokenizer, chat template, generation defaults; `load_text_model`) enables text
    prompts, chat, `stop` strings and `text` in responses; a bare `tokenizer` is the same with
    the built-in template for the byte tokenizer. Without either, prompts are token ids only.
    `cache_profile` (default: the backend's `cache_profile`, if it has one) is what explain
    reports about the layout; the last `max_explained_requests` lookups are kept for it."""
    app = FastAPI(title="hybridserve", version=VERSION)
    metrics = app.state.metrics = Metrics()
    metrics.num_unfinished.set_function(lambda: backend.num_unfinished)
    backend.attach_metrics(metrics)
    profile = cache_profile if cache_profile is not None else getattr(backend, "cache_profile", None)
    reports = app.state.cache_reports = CacheReports(metrics.registry, profile, max_explained_requests)
    api = Api(backend, model_name, text or default_text_model(tokenizer), metrics,
              RequestDriver(backend, metrics, reports), model_root)
    app.add_middleware(HttpGuard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics, routes=ROUTES)
    install_error_handlers(app)
    for routes in (info_routes, token_routes, completion_routes, chat_routes):
        app.include_router(routes(api))
    app.include_router(cache_routes(reports))
    return app
