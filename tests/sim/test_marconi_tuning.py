"""Marconi's alpha tuned as its published code does (`cache_service/trace_sim/tuning.py`): alpha 0
until 5 x the requests seen at the first eviction, the best alpha of 0-2 on a replay of that
window by FLOPs saved, then that alpha on the same cache; and the eviction counters it reads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cache_service.block_hash import BlockHash
from cache_service.block_pool import BlockPool
from cache_service.trace_sim import cli
from cache_service.trace_sim.cli import main
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.stepped_engine import SteppedClusterSim
from cache_service.trace_sim.tuning import (
    PUBLISHED_ALPHAS,
    first_eviction,
    run_bootstrapped,
    tune_marconi_alpha,
)
from tests.sim.test_trace_sim import COST, LAYOUT, make_request

BUDGET = 200_000  # mamba_fraction 0.1: 4 state pages besides the null one; 180 KV blocks of 64 tokens


def settings(eviction: str = "marconi") -> SimSettings:
    return SimSettings(LAYOUT, COST, 1, "hybrid", BUDGET, mamba_fraction=0.1, eviction=eviction)


def long_and_shorts(reps: int = 4, shorts: int = 6) -> list:
    """A 4,096-token prompt, then `shorts` distinct 512-token ones, `reps` times: the long prompt's
    state survives the shorts only if FLOPs saved per byte (alpha) outweighs recency."""
    reqs, nxt = [], 1000
    for _ in range(reps):
        reqs.append(make_request(len(reqs), 10.0 * len(reqs), list(range(8))))
        for _ in range(shorts):
            reqs.append(make_request(len(reqs), 10.0 * len(reqs), [nxt]))
            nxt += 1
    return reqs


def test_the_block_pool_counts_what_allocation_and_a_policy_evict():
    pool = BlockPool(3)  # 2 usable blocks
    a, b = pool.allocate(2)
    pool.cache_block(a, BlockHash(b"a"))
    pool.cache_block(b, BlockHash(b"b"))
    pool.free([a, b])
    assert pool.num_evictions == 0
    pool.free(pool.allocate(1))  # takes a cached block: its hash is evicted
    assert pool.num_evictions == 1
    assert pool.evict(BlockHash(b"b")) and pool.num_evictions == 2
    assert not pool.evict(BlockHash(b"b")) and pool.num_evictions == 2  # nothing dropped: not counted


def test_first_eviction_is_the_request_whose_step_first_evicted():
    reqs = long_and_shorts()
    sim, expected = ClusterSim(settings("marconi:0")), None
    for i, req in enumerate(reqs, 1):
        sim.step(req)
        if sum(p.num_evictions for p in sim.caches[0].cache.pools) > 0:  # KV or state, counted here
            expected = i
            break
    assert expected is not None and expected > 1
    assert first_eviction(settings(), reqs) == expected
    assert first_eviction(settings(), reqs[: expected - 1]) is None  # never evicts: no tuning


def test_the_bootstrap_replays_5_n0_requests_and_keeps_the_alpha_that_saved_most():
    reqs = long_and_shorts()
    tuning = tune_marconi_alpha(settings(), reqs)
    n0 = first_eviction(settings(), reqs)
    assert (tuning.first_eviction, tuning.window) == (n0, 5 * n0)
    assert set(tuning.flops_saved) == set(PUBLISHED_ALPHAS)
    assert tuning.flops_saved[0.0] < tuning.flops_saved[2.0]  # recency alone loses the long prompt
    best = max(tuning.flops_saved.values())
    assert tuning.alpha == min(a for a, v in tuning.flops_saved.items() if v == best)  # ties: the smallest
    # each candidate's figure is that alpha's own replay of the window, from an empty cache
    replay = ClusterSim(settings(f"marconi:{tuning.alpha}")).run(reqs[: tuning.window])
    cost = ClusterSim(settings()).eviction.build().cost
    assert sum(cost(r.hit_tokens) for r in replay) == tuning.flops_saved[tuning.alpha]


class _Bar:
    def __init__(self, description: str, total: int) -> None:
        self.description, self.total, self.n, self.closed = description, total, 0, False

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


def test_each_phase_shows_its_progress_to_the_end():
    reqs, bars = long_and_shorts(), []
    tuning = tune_marconi_alpha(settings(), reqs, progress=lambda d, t: bars.append(_Bar(d, t)) or bars[-1])
    run, replays = bars
    assert (run.total, run.n, run.closed) == (len(reqs), tuning.first_eviction, True)  # stopped at n0
    assert replays.total == replays.n == len(PUBLISHED_ALPHAS) * tuning.window and replays.closed
    assert f"over its first {tuning.window} requests" in replays.description


def test_a_cache_that_never_evicts_stays_at_alpha_0():
    tuning = tune_marconi_alpha(settings(), long_and_shorts()[:2])
    assert (tuning.alpha, tuning.first_eviction, tuning.window, tuning.flops_saved) == (0.0, None, 0, {})


def test_the_same_cache_runs_alpha_0_through_the_window_then_the_tuned_alpha():
    reqs = long_and_shorts()
    tuning = tune_marconi_alpha(settings(), reqs)
    sim = ClusterSim(settings("marconi:0"))
    (manager,) = sim.caches[0].cache.groups.of_kind("mamba")
    seen = []
    records = run_bootstrapped(sim, reqs, tuning, lambda _r: seen.append(manager.eviction.alpha))
    assert seen == [0.0] * (tuning.window - 1) + [tuning.alpha] * (len(reqs) - tuning.window + 1)
    hits = [r.hit_tokens for r in records]
    # the long prompt (every 7th) misses while alpha is 0 and hits once the tuned alpha kept its state
    assert [hits[i] for i in range(7, len(reqs), 7)] == [0, 0, 4032]
    assert hits != [r.hit_tokens for r in ClusterSim(settings("marconi:0")).run(reqs)]


def test_a_stepped_cluster_takes_the_tuned_alpha_from_the_start():
    s = SimSettings(LAYOUT, replace(COST, step_token_budget=1024), 1, "hybrid", BUDGET, mamba_fraction=0.1,
                    eviction="marconi:0", decode_model="stepped")
    sim = SteppedClusterSim(s)
    tuning = tune_marconi_alpha(settings(), long_and_shorts())
    run_bootstrapped(sim, [], tuning)
    (manager,) = sim.caches[0].cache.groups.of_kind("mamba")
    assert manager.eviction.alpha == tuning.alpha > 0


@pytest.mark.timeout(300)
def test_simulate_reports_the_tuning_and_the_alpha_it_ran_with(capsys, monkeypatch):
    """The CLI runs the trace through `run_bootstrapped` with the tuning it reports (a spy around
    the real function: a CLI that ran the whole trace at alpha 0 or at the tuned alpha would pass
    the summary checks alone)."""
    seen = []

    def spy(sim, requests, tuning, on_step=None):
        seen.append((sim.settings.eviction, len(requests), tuning))
        return run_bootstrapped(sim, requests, tuning, on_step)

    monkeypatch.setattr(cli, "run_bootstrapped", spy)
    assert main(["--replicas", "1", "--memory-share", "0.1", "--limit", "120", "--retention", "latest",
                 "--eviction", "marconi", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    summary = summary[0] if isinstance(summary, list) else summary
    tuning = summary["marconi_tuning"]
    ((eviction, num_requests, used),) = seen
    assert (eviction, num_requests, used.as_dict()) == ("marconi:0", 120, tuning)
    assert summary["eviction"] == f"marconi:{tuning['alpha']}"
    assert tuning["window"] == 5 * tuning["first_eviction"] or tuning["window"] == 120
    assert len(tuning["flops_saved"]) == len(PUBLISHED_ALPHAS)
