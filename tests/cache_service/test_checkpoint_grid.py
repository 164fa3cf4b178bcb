"""The checkpoint grid in `explain` and `hybridserve simulate` (`--checkpoint-grid`): on the
attention grid the seed layout's resend lands where vLLM 0.33's does, and the Mamba block only
bounds the spacing of states.

Wrong changes this catches: the flag parsed but not applied (the hits stay on 2304), the spacing
bound dropped (no states at 2304, 4608, 6912), the simulator's planner built without it, and a bad
grid name accepted."""

from __future__ import annotations

import json

import pytest

from cache_service.explain import main
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from tests.sim.test_trace_sim import COST, make_request

SEED = ["--group", "full:64"] + ["--group", "mamba:2304"] * 3


def explain(args, capsys) -> dict:
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("eagle", "mamba_grid", "attention_grid"), [
    (["--eagle", "lossless"], 6912, 8896),  # vLLM 0.33: 8,896
    (["--eagle", "drop", "--num-spec-tokens", "3"], 6912, 8832),  # the block at 8,896 runs past the prompt
    (["--eagle", "off"], 6912, 8896),
])
def test_the_seed_resend_on_each_grid(capsys, eagle, mamba_grid, attention_grid):
    base = SEED + eagle + ["--prompt-len", "8901"]
    old = explain(base, capsys)
    new = explain(base + ["--checkpoint-grid", "attention"], capsys)
    assert (old["hit_tokens"], new["hit_tokens"]) == (mamba_grid, attention_grid)
    assert new["groups"] == ["full:64", "mamba:64", "mamba:64", "mamba:64"] and new["alignment"] == 64
    assert {2304, 4608, 6912} <= set(new["cold"]["checkpoints"])  # the spacing bound
    assert "at least every 2304 tokens" in new["needs"][1] and new["checkpoint_grid"] == "attention"


def test_a_bad_grid_is_refused(capsys):
    assert main(SEED + ["--prompt-len", "100", "--checkpoint-grid", "page"]) == 2
    assert "--checkpoint-grid: checkpoint grid must be attention or mamba" in capsys.readouterr().err


def test_the_simulator_runs_the_grid():
    from cache_service.specs import CacheLayout, parse_group_spec
    from cache_service.trace_sim.config import SimLayout

    layout = SimLayout("t", CacheLayout((parse_group_spec("full:512"), parse_group_spec("mamba:2048"))),
                       (2**20, 2**24))
    hits = {}
    for grid in ("mamba", "attention"):
        sim = ClusterSim(SimSettings(layout, COST, 1, "hybrid", 10**10, checkpoint_grid=grid))
        first = [0, 1, 2, 3, 4, 5, 6]  # 7 trace blocks of 512 tokens
        sim.step(make_request(0, 0.0, first))
        hits[grid] = sim.step(make_request(1, 10.0, first[:6] + [9])).hit_tokens  # a sibling sharing 3072
        hits[grid + " resend"] = sim.step(make_request(2, 20.0, first)).hit_tokens
        states = sim.caches[0].cache.groups.of_kind("mamba")[0].eviction.known()
        hits[grid + " states"] = sorted(e.position for e in states.values())
    # the first request's replay boundary: floor(3583 / 2048) * 2048 = 2048 on the Mamba grid,
    # floor(3583 / 512) * 512 = 3072 on the attention grid (plus the spacing state at 2048), where
    # the sibling and the resend land; on the attention grid each prompt's final boundary, 3584,
    # is a state too
    assert hits == {"mamba": 2048, "mamba resend": 2048, "mamba states": [2048],
                    "attention": 3072, "attention resend": 3072, "attention states": [2048, 3072, 3584, 3584]}
