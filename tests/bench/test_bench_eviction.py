"""`python -m bench.eviction` end to end at small sizes: every policy decides, the growth ratios
and the simulator comparison are reported (no timing is asserted: the machine is shared)."""

import json

from bench.eviction import decision_cost, main


def test_eviction_benchmark_reports_decisions_growth_and_the_simulator_ratio(capsys):
    assert main(["--sizes", "200,2000", "--marconi-sizes", "100,200", "--decisions", "300",
                 "--marconi-decisions", "20", "--sim-requests", "40"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["policy"], r["num_states"]): r for r in report["decisions"]}
    assert set(rows) == {("lru", 200), ("lru", 2000), ("value", 200), ("value", 2000),
                         ("value:auto", 200), ("value:auto", 2000), ("marconi", 100), ("marconi", 200)}
    assert all(0 < r["us_median"] <= r["us_p99"] <= r["us_max"] for r in rows.values())
    assert all(r["us_per_decision"] <= r["us_max"] for r in rows.values())
    assert {"lru_growth", "value_growth", "value:auto_growth", "marconi_growth", "value_median_growth"} <= set(report)
    sims = report["simulator"]
    assert [s["eviction"] for s in sims] == ["lru", "value", "lru", "value", "value:auto"]
    assert all(s["num_requests"] == 40 for s in sims)
    assert report["simulator_value_over_lru"] > 0 and report["simulator_placed_over_lru"] > 0
    assert report["simulator_auto_over_lru"] > 0
    assert [s["retention"] for s in report["simulator"]] == ["dense", "dense", "latest", "value:3e8", "dense"]


def test_each_decision_evicts_one_state_and_keeps_the_pool_full():
    """The benchmark's loop is a real steady state: a victim every time (never None: that would
    crash `removed`/`index.pop`), the pool size unchanged."""
    for policy in ("lru", "value", "value:auto", "marconi"):
        assert decision_cost(policy, 50, 200)["num_decisions"] == 200
