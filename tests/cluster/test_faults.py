"""Fault injection on a simulated 2-node Ray cluster under HTTP loadtest traffic (`bench.faults` at a
small size): every greedy request finishes with status 200 and its cold output; the only retryable
error allowed is the documented one (an unseeded sampled request that had already streamed when its
replica died: its tokens cannot be regenerated), and exactly as many as the scenario provokes; and
the cluster index is consistent again after each fault (how fast is measured by `python -m
bench.faults`, not asserted here).

Marked `chaos` (with the multi-host fault tests): its seven scenarios take about 85 s on 2 cores, so
`make chaos` runs it and `make test` deselects it; `make test` still runs the fault bench's
`drop_events` scenario (`tests/bench/test_bench_outputs.py`) and the kill tests of
`test_ray_cluster.py`, `test_replica_restart_ray.py` and `test_frontdoors.py`."""

import os
import tempfile

import pytest

from bench.faults import SCENARIOS, FaultConfig, format_table, run_scenarios, two_node_cluster

pytestmark = [pytest.mark.chaos, pytest.mark.heavy, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def results():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rf", dir="/tmp")  # unix socket paths stay short
    config = FaultConfig(num_prompts=3, prompt_len=256, max_tokens=16, recovery_timeout_s=20.0)
    with two_node_cluster():
        out = {r.name: r for r in run_scenarios(config)}
    print(format_table(list(out.values())))
    return out


# The kills start three probes on the victim, each past its first token when it dies (bench.faults):
# greedy and seeded ones must resume elsewhere; the unseeded sampled one is the documented case.
DOCUMENTED_RETRYABLE = {"kill_replica": 1, "kill_tp_rank": 1}


@pytest.mark.parametrize("name", SCENARIOS)
def test_fault_loses_nothing_changes_no_output_and_the_index_recovers(results, name):
    r = results[name]
    documented = DOCUMENTED_RETRYABLE.get(name, 0)
    assert r.sent >= 6 and r.completed == r.sent - documented, r.details  # every greedy request: 200
    assert r.retryable_errors == r.documented_retryable == documented, r.details
    assert all("unseeded sampled request had streamed" in why for why in r.details.get("retryable_why", []))
    assert r.lost == 0 and r.differing == 0, r.details
    assert r.recovery_s is not None, r.details  # recovered within the bench's bounded wait (timing: bench.faults)


def test_each_fault_did_happen(results):
    d = {name: r.details for name, r in results.items()}
    assert d["drop_events"].get("service_resyncs", 0) >= 1  # the gap was seen and repaired
    assert d["reorder_events"].get("service_resyncs", 0) >= 1
    assert d["corrupt_transfer"].get("transfer_failures", 0) >= 1  # refused by the checksum
    assert d["evict_while_routed"]["pages_evicted"] > 0
    assert d["kill_cache_service"].get("service_resyncs", 0) >= 2  # both replicas rebuilt into it
    for name in ("kill_replica", "kill_tp_rank"):
        # purged; its replacement (a fixed count: cluster.control.replica_restarts) may still be starting
        assert d[name]["replica_deaths"] == 1 and d[name].get("replica_restarts", 0) <= 1
        assert 1 <= len(d[name]["replicas_after"]) <= 2
        # the greedy and the seeded probe were mid-stream on the victim: both resumed elsewhere
        assert d[name]["retries"] >= 2 and sorted(d[name]["probes_completed"]) == ["greedy", "seeded"]
