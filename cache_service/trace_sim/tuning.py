"""Marconi's alpha, tuned as its published code does (`ruipeterpan/marconi`, `radix_cache_hybrid.py`
and `config_tuner.py`), for `hybridserve simulate --eviction marconi` with no alpha given:

    bootstrap   the cache runs with alpha 0 until it has seen 5 x n0 requests, n0 being the
                requests it had seen when it first evicted anything
    tuning      then it replays those first 5 x n0 requests from an empty cache with every alpha
                in 0, 0.1, ..., 2.0 and keeps the one that saved the most recompute FLOPs (ties:
                the smallest alpha; the published code takes whichever replay finished first)
    after       the same cache goes on with that alpha; it is tuned once

A cache that never evicts needs no alpha: it stays at 0. Here the cluster is one unit: n0 counts
the cluster's requests until any replica first evicts a page (KV block or state), and every
replica switches at the same request. The stepped decode model (`--decode-model stepped`, P/D)
learns its records only at the end, so there the tuned alpha holds from the first request (the
tuning itself runs on the plain model).

`MARCONI_ALPHAS` is a coarser, wider grid for `bench.memory_pressure`'s best alpha in hindsight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from cache_service.eviction import EvictionConfig
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.trace import TraceRequest

MARCONI_ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
PUBLISHED_ALPHAS = tuple(i / 10 for i in range(21))  # config_tuner.py's grid
BOOTSTRAP_MULTIPLIER = 5  # radix_cache_hybrid.py's default


@dataclass(frozen=True)
class MarconiTuning:
    """What the bootstrap found: the alpha used after `window` requests (alpha 0 before)."""

    alpha: float
    first_eviction: int | None  # requests seen when a page was first evicted; None: never
    window: int  # requests run at alpha 0 and replayed for the tuning (0: no tuning)
    flops_saved: dict[float, float]  # per candidate alpha, recompute FLOPs its replay saved

    def as_dict(self) -> dict:
        return {"alpha": self.alpha, "first_eviction": self.first_eviction, "window": self.window,
                "flops_saved": {str(a): v for a, v in self.flops_saved.items()}}


def num_evictions(sim: ClusterSim) -> int:
    """Pages (KV blocks and states) the cluster's device pools have evicted so far."""
    caches = {id(c): c for c in sim.caches}.values()  # the oracle's queues share one cache
    return sum(p.num_evictions for c in caches for p in c.cache.pools)


def set_alpha(sim: ClusterSim, alpha: float) -> None:
    """Switch every replica's Marconi state policy to `alpha` (the bootstrap's end)."""
    for c in {id(c): c for c in sim.caches}.values():
        for manager in c.cache.groups.of_kind("mamba"):
            manager.eviction.alpha = alpha


def _until(requests: Sequence[TraceRequest], stop: Callable[[], bool]) -> Iterator[TraceRequest]:
    for req in requests:
        if stop():
            return
        yield req


def first_eviction(settings: SimSettings, requests: Sequence[TraceRequest],
                   on_step: Callable[[object], None] | None = None) -> int | None:
    """Requests the cluster has seen (the evicting one included) when it first evicts, at alpha 0.
    `on_step(record)` after each request run."""
    sim = ClusterSim(replace(settings, eviction="marconi:0"))
    seen: list[int] = []
    done = 0

    def step(record) -> None:
        nonlocal done
        done += 1
        if not seen and num_evictions(sim) > 0:
            seen.append(done)
        if on_step is not None:
            on_step(record)

    sim.run(_until(requests, lambda: bool(seen)), step)
    return seen[0] if seen else None


class Progress(Protocol):
    """A progress bar (tqdm's interface): `update(1)` per request run, `close()` at the end."""

    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


def ticks(bar: Progress | None) -> Callable[[object], None] | None:
    """An `on_step` that ticks `bar` once per request run (None without a bar)."""
    return (lambda _record: bar.update(1)) if bar is not None else None


def tune_marconi_alpha(settings: SimSettings, requests: Sequence[TraceRequest],
                       alphas: Sequence[float] = PUBLISHED_ALPHAS,
                       multiplier: int = BOOTSTRAP_MULTIPLIER,
                       progress: Callable[[str, int], Progress] | None = None) -> MarconiTuning:
    """Marconi's bootstrap on `requests` (module docstring). `progress(description, total)`: a
    bar for each phase (the run to the first eviction, the replays), ticked per request."""
    bar = progress("marconi: run to its first eviction", len(requests)) if progress is not None else None
    n0 = first_eviction(settings, requests, ticks(bar))
    if bar is not None:
        bar.close()
    if n0 is None:
        return MarconiTuning(0.0, None, 0, {})
    window = list(requests[: multiplier * n0])
    cost = EvictionConfig(settings.eviction, settings.layout.attention_crossover_tokens).build().cost
    bar = progress(f"marconi: {len(alphas)} alphas over its first {len(window)} requests",
                   len(alphas) * len(window)) if progress is not None else None
    saved = {}
    for alpha in alphas:
        records = ClusterSim(replace(settings, eviction=f"marconi:{alpha}")).run(window, ticks(bar))
        saved[alpha] = sum(cost(r.hit_tokens) for r in records)
    if bar is not None:
        bar.close()
    best = max(alphas, key=lambda a: (saved[a], -a))
    return MarconiTuning(best, n0, len(window), saved)


def run_bootstrapped(sim: ClusterSim, requests: Sequence[TraceRequest], tuning: MarconiTuning,
                     on_step: Callable | None = None) -> list:
    """Run `requests` on a `marconi:0` cluster, switching to the tuned alpha after the window (at
    once on a model that steps every request before reporting any: module docstring)."""
    count = 0

    def step(record) -> None:
        nonlocal count
        count += 1
        if count == tuning.window:
            set_alpha(sim, tuning.alpha)
        if on_step is not None:
            on_step(record)

    if tuning.window == 0 or type(sim).step is not ClusterSim.step:
        set_alpha(sim, tuning.alpha)
    return sim.run(requests, step)
