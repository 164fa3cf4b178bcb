"""What the HTTP front end drives: the `Backend` protocol.

Two implementations: `workers.engine_runner.EngineRunner` (one engine in this process) and
`cluster.frontdoor.backend.ClusterBackend` (a front door onto the Ray cluster). Test doubles
implement it whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cluster.http.metrics import Metrics
    from workers.engine.sampling_params import SamplingParams
    from workers.engine_runner import RequestStream


class Backend(Protocol):
    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not finished (the `/health` body and a gauge)."""

    @property
    def max_model_len(self) -> int | None:
        """Prompt + max_tokens over this is a 400, as in vLLM (None: no limit known here)."""

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               cache_salt: str | None = None) -> RequestStream:
        """Accept one request; its outputs arrive on the stream. Raises `InvalidRequestError` for
        bad input and `ServerOverloadedError` when full, at once. May block briefly (called in a
        thread)."""

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away, or a stop string ended it); fire-and-forget."""

    def attach_metrics(self, metrics: Metrics) -> None:
        """Called once with the front end's `Metrics`: the backend records its own events there
        (routes, transfers) and hands over counters read at each scrape."""
