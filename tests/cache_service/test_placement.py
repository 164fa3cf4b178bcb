"""Placement by expected value (`value:BYTES`, `cache_service/placement.py`): the dynamic program
finds the best positions (checked against every subset), keeps the boundaries, respects the budget,
learns from a bounded window, and in a simulation gives a hit `latest` cannot.

Wrong changes this catches: a greedy or off-by-one DP (the brute force disagrees), picking more
states than the budget or returning a boundary as a placed state, an unbounded or never-forgetting window, and the
simulator not feeding its lookups to the planner (no depth learned: no hit)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from cache_service.eviction_policy import RecomputeCost
from cache_service.placement import MatchDepthStats, ValuePlacement, best_positions, parse_value_placement
from cache_service.retention import make_retention
from cache_service.specs import SpecError
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from tests.sim.test_trace_sim import COST, LAYOUT, make_request


def value_of(chosen, survival, cost) -> float:
    """value(Q) of the module doc, straight from its definition: each lookup whose match ends at
    d restores the deepest state <= d (survival: p -> S(p), a step function)."""
    total, below = 0.0, 0
    for q in sorted(chosen):
        total += (cost(q) - cost(below)) * survival(q)
        below = q
    return total


def brute_force(candidates, forced, budget, cost, survival) -> float:
    free = [p for p, _ in candidates if p not in forced]
    return max(value_of(set(forced) | set(pick), survival, cost)
               for k in range(min(budget, len(free)) + 1) for pick in itertools.combinations(free, k))


@pytest.mark.parametrize("crossover", [float("inf"), 300.0])
def test_the_dynamic_program_finds_the_best_positions(crossover):
    rng = random.Random(7)
    cost = RecomputeCost(crossover)
    for trial in range(300):
        stats = MatchDepthStats()
        for _ in range(rng.randrange(1, 30)):
            stats.observe(rng.randrange(0, 1200), 64)
        num_tokens = rng.randrange(64, 1300)
        candidates = stats.survival(num_tokens + 1)
        grid = range(64, num_tokens + 1, 64)
        forced = sorted(rng.sample(grid, rng.randrange(0, min(3, len(grid) + 1))))
        budget = rng.randrange(0, 4)
        chosen = best_positions(candidates, forced, budget, cost, stats.reach_share)
        assert len(chosen) <= budget and not set(chosen) & set(forced), trial
        assert set(chosen) <= {p for p, _ in candidates}, trial
        best = brute_force(candidates, forced, budget, cost, stats.reach_share)
        got = value_of(set(forced) | set(chosen), stats.reach_share, cost)
        assert got == pytest.approx(best, rel=1e-12), trial


def test_positions_by_hand():
    policy = parse_value_placement("value:8000", 4000)
    assert policy.max_states == 2 and policy.name == "value:8000"
    for match in (1024, 1024, 512, 0, 1000):  # 1000 counts as 960 (aligned)
        policy.observe(match, 64)
    # S: 512 -> 4/5, 960 -> 3/5, 1024 -> 2/5
    # one state: 512 * 4/5 = 409.6, 960 * 3/5 = 576, 1024 * 2/5 = 409.6 -> 960
    assert tuple(ValuePlacement(1, stats=policy.stats).periodic_positions(2000, 64)) == (960,)
    # two: {512, 960}: 409.6 + 448 * 3/5 = 678.4 beats {960, 1024}: 576 + 64 * 2/5 = 601.6
    assert tuple(policy.periodic_positions(2000, 64)) == (512, 960)
    # with a boundary at 960 kept anyway, the two free states go to 512 and 1024
    assert tuple(policy.periodic_positions(2000, 64, fixed={960})) == (512, 1024)
    assert tuple(policy.periodic_positions(1000, 64)) == (512, 960)  # nothing past the prompt
    assert tuple(parse_value_placement("value:3999", 4000).periodic_positions(2000, 64)) == ()


def test_parsing_and_errors():
    assert make_retention("value:3e8", 64, state_bytes=10**8).max_states == 3
    for bad in ("value:lots", "value:-5"):
        with pytest.raises(SpecError, match="value:BYTES|>= 0"):
            make_retention(bad, 64, state_bytes=100)
    with pytest.raises(SpecError, match="state bytes"):
        make_retention("value:100", 64)


def test_the_window_forgets_old_lookups():
    stats = MatchDepthStats(window=3)
    assert stats.reach_share(64) == 0.0 and stats.survival(1000) == []
    for match in (640, 640, 128, 128, 128):
        stats.observe(match, 64)
    assert len(stats) == 3 and stats.version == 5
    assert stats.survival(1000) == [(128, 1.0)]  # the two 640s left the window
    assert stats.reach_share(640) == 0.0


@pytest.mark.parametrize(("retention", "expected"), [("latest", 0), ("value:4000", 1024)])
def test_learned_depth_gives_a_new_conversation_its_first_sibling_hit(retention, expected):
    sim = ClusterSim(SimSettings(LAYOUT, COST, 1, "hybrid", 10**8, retention=retention, mamba_fraction=0.5))
    sim.step(make_request(0, 0.0, [0, 1, 2]))
    sim.step(make_request(1, 10.0, [0, 1, 5]))  # a match to 1024: the policy learns that depth
    sim.step(make_request(2, 20.0, [9, 10, 11]))  # a new prefix: value keeps a snapshot at 1024
    assert sim.step(make_request(3, 30.0, [9, 10, 12])).hit_tokens == expected


def test_every_front_takes_the_spelling_and_refuses_bad_budgets(capsys):
    from cache_service.explain import main as explain_main
    from workers.engine.config import EngineConfig
    from workers.engine.errors import EngineConfigError

    assert EngineConfig(retention="value:3e8").retention == "value:3e8"
    with pytest.raises(EngineConfigError, match="retention: .*value:BYTES"):
        EngineConfig(retention="value:lots")
    args = ["--group", "full:64", "--group", "mamba:64", "--prompt-len", "300"]
    # one prompt and its resend: nothing learned yet, so it keeps what latest keeps
    assert explain_main(args + ["--retention", "value:2"]) == 0
    placed = capsys.readouterr().out
    assert explain_main(args + ["--retention", "latest"]) == 0
    latest = capsys.readouterr().out
    placed, latest = json.loads(placed), json.loads(latest)
    assert placed["hit_tokens"] == latest["hit_tokens"] == 256
    assert placed["cold"]["checkpoints"] == latest["cold"]["checkpoints"] == [256]
    assert "up to 2 bytes per request where later lookups are expected to land" in placed["needs"][1]
    assert explain_main(args + ["--retention", "value:-1"]) == 2
    assert "BYTES must be >= 0" in capsys.readouterr().err
