"""The byte-budgeted expected-value retention: exact positions from the learned match depths,
and a hit in the simulation that latest-only retention cannot give."""

from __future__ import annotations

import pytest

from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.value_retention import MatchDepthStats, parse_value_retention
from tests.sim.test_trace_sim import COST, LAYOUT, make_request


def test_positions_rank_by_depth_times_reach():
    policy = parse_value_retention("value:8000", 4000)
    assert policy is not None and policy.max_snapshots == 2
    for match in (1024, 1024, 512, 0, 1000):  # 1000 counts as 960 (aligned)
        policy.stats.observe(match, 64)
    # reach: 512 -> 4/5, 960 -> 3/5, 1024 -> 2/5; value 409.6, 576, 409.6
    assert list(policy.periodic_positions(2000, 64)) == [960, 1024]
    assert list(policy.periodic_positions(1000, 64)) == [512, 960]
    assert list(parse_value_retention("value:3999", 4000).periodic_positions(2000, 64)) == []
    assert parse_value_retention("latest", 4000) is None
    with pytest.raises(ValueError, match="value:BYTES"):
        parse_value_retention("value:lots", 4000)


def test_stats_are_empty_until_observed():
    assert MatchDepthStats().reach_share(64) == 0.0


@pytest.mark.parametrize(("retention", "expected"), [("latest", 0), ("value:4000", 1024)])
def test_learned_depth_gives_a_new_conversation_its_first_sibling_hit(retention, expected):
    sim = ClusterSim(SimSettings(LAYOUT, COST, 1, "hybrid", 10**8, retention=retention, mamba_fraction=0.5))
    sim.step(make_request(0, 0.0, [0, 1, 2]))
    sim.step(make_request(1, 10.0, [0, 1, 5]))  # a match to 1024: the policy learns that depth
    sim.step(make_request(2, 20.0, [9, 10, 11]))  # a new prefix: value keeps a snapshot at 1024
    assert sim.step(make_request(3, 30.0, [9, 10, 12])).hit_tokens == expected
