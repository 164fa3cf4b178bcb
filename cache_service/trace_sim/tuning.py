"""Marconi's alpha, tuned as its paper does: run the trace's first part with each candidate and
keep the one with the highest token hit rate (ties: the smaller alpha)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.trace import TraceRequest

MARCONI_ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def tune_marconi_alpha(settings: SimSettings, requests: Sequence[TraceRequest], share: float = 0.1,
                       alphas: Sequence[float] = MARCONI_ALPHAS) -> tuple[float, dict[float, float]]:
    """The best alpha on the first `share` of `requests`, and each candidate's hit rate there."""
    prefix = list(requests[: max(1, int(len(requests) * share))])
    num_input = sum(r.input_length for r in prefix)
    scores = {}
    for alpha in alphas:
        records = ClusterSim(replace(settings, eviction=f"marconi:{alpha}")).run(prefix)
        scores[alpha] = sum(r.hit_tokens for r in records) / num_input if num_input else 0.0
    best = max(alphas, key=lambda a: (scores[a], -a))
    return best, scores
