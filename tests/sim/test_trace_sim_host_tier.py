"""The trace simulator's host tier (issue 29, item 4): a prefix the device evicts hits again from
the host, the request pays exactly the modeled copy, the summary counts it; budgets, cost models
and the CLI flags refuse bad values with clear errors."""

from __future__ import annotations

import json

import pytest

from cache_service.specs import CacheLayout, parse_group_spec
from cache_service.trace_sim.cli import build_parser, main
from cache_service.trace_sim.config import CostModel, SimConfigError, SimLayout, load_cost_model
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.summary import summarize
from cache_service.trace_sim.trace import TraceRequest

H2D = 1e6  # host->device bytes/s: 1,000 B (one KV block) copy in 1 ms
COST = CostModel("test", prefill_tokens_per_s=1000.0, prefill_overhead_s=0.0, decode_step_s=0.01,
                 transfer_bytes_per_s=1e12, host_to_device_bytes_per_s=H2D)
HYBRID = SimLayout("test", CacheLayout((parse_group_spec("full:64"), parse_group_spec("mamba:64"))), (1000, 4000))
ATTENTION = SimLayout("attn", CacheLayout((parse_group_spec("full:64"),)), (1000,))
# 34,000 B at mamba_fraction 0.5: 17 KV blocks (16 usable + null), 4 state pages: one
# 1024-token prompt (16 blocks) fills the KV pool
DEVICE = 34_000


def make_request(index: int, arrival_s: float, hash_ids: list[int]) -> TraceRequest:
    return TraceRequest(index, arrival_s, len(hash_ids) * 512, 4, tuple(hash_ids))


def make_sim(host_bytes: int, layout: SimLayout = HYBRID, eviction: str = "value", cost: CostModel = COST,
             budget: int = DEVICE) -> ClusterSim:
    return ClusterSim(SimSettings(layout, cost, 1, "hybrid", budget, eviction=eviction, mamba_fraction=0.5,
                                  host_bytes=host_bytes))


def evict_then_resend(sim: ClusterSim):
    """A (1024 tokens), B (1024 other tokens: takes every KV block and the state pool), A again."""
    sim.step(make_request(0, 0.0, [0, 1]))
    sim.step(make_request(1, 10.0, [5, 6]))
    return sim.step(make_request(2, 20.0, [0, 1]))


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_a_prefix_the_device_evicted_hits_from_the_host_and_pays_exactly_its_copy(eviction):
    """Catches: the host budget not reaching the pools (no hit), host pages priced at the wrong
    bandwidth or not at all (TTFT), all hit pages priced instead of the host-only ones, a hit
    through the host not counted as one (host_hit_tokens)."""
    without = evict_then_resend(make_sim(0, eviction=eviction))
    assert (without.hit_tokens, without.host_hit_tokens, without.promoted_bytes) == (0, 0, 0)
    sim = make_sim(4 * DEVICE, eviction=eviction)
    assert sim.num_host_pages_per_group == (68, 17)  # 68,000 B / 1,000 and 68,000 B / 4,000
    resend = evict_then_resend(sim)
    # the replay boundary 960: 15 KV blocks and the state at 960, all of them demoted by B
    assert resend.hit_tokens == resend.host_hit_tokens == 960
    assert resend.promoted_bytes == 15 * 1000 + 4000
    prefill_s = (1024 - 960) / 1000.0
    assert resend.ttft_s == pytest.approx(prefill_s + (15 * 1000 + 4000) / H2D)


def test_only_the_host_only_pages_of_a_partly_evicted_hit_are_priced():
    """Catches: pricing every page of a hit that promotes any (the device still holds half).
    Attention only: B (512 tokens, 8 blocks) evicts A's last 8 blocks (freed tail first), so the
    resend's 15-block hit has blocks 9-15 on the host only."""
    sim = make_sim(4 * 17_000, layout=ATTENTION, budget=17_000)
    sim.step(make_request(0, 0.0, [0, 1]))
    sim.step(make_request(1, 10.0, [5]))
    resend = sim.step(make_request(2, 20.0, [0, 1]))
    assert (resend.hit_tokens, resend.host_hit_tokens, resend.promoted_bytes) == (960, 960, 7 * 1000)
    assert resend.ttft_s == pytest.approx(0.064 + 7 * 1000 / H2D)
    again = sim.step(make_request(3, 30.0, [0, 1]))  # promoted at the resend's admission: on the device now
    assert (again.hit_tokens, again.host_hit_tokens, again.promoted_bytes) == (960, 0, 0)
    assert again.ttft_s == pytest.approx(0.064)


def test_the_summary_counts_hits_through_the_host_and_the_bytes_promoted():
    """Catches: summary fields missing or summed from the wrong records, the tiers' counters not
    read (promoted pages = the 15 KV blocks + 1 state of the resend)."""
    sim = make_sim(4 * DEVICE)
    records = [sim.step(make_request(0, 0.0, [0, 1])), sim.step(make_request(1, 10.0, [5, 6])),
               sim.step(make_request(2, 20.0, [0, 1]))]
    sim._publish_until(float("inf"))
    summary = summarize(sim, records, 1.0)
    assert summary["num_hit_tokens"] == summary["num_host_hit_tokens"] == 960
    assert summary["host_hit_rate"] == pytest.approx(960 / 3072)
    assert summary["num_promoted_bytes"] == 19_000
    assert summary["host_pages_promoted"] == 16
    assert summary["host_bytes_per_replica"] == 4 * DEVICE
    assert summary["num_host_pages_per_group"] == [68, 17]
    plain = summarize(make_sim(0), [], 1.0)  # no tier: the same fields, zero
    assert (plain["num_host_pages_per_group"], plain["num_host_hit_tokens"], plain["num_promoted_bytes"]) == ([], 0, 0)


def test_host_budgets_are_validated_with_clear_errors():
    """Catches: a negative host budget accepted, one too small for a page per group silently
    giving a group no tier, a host run on a cost model without a copy bandwidth pricing copies
    as free."""
    with pytest.raises(ValueError, match="--host-memory-gib must be >= 0"):
        make_sim(-1)
    with pytest.raises(SimConfigError, match="every group needs at least 1"):
        make_sim(1000)  # 500 B for KV, 500 B for states: no page of either
    assert HYBRID.host_pages(0, 0.5) == ()
    assert HYBRID.host_pages(8000, 0.5) == (4, 1)
    old = CostModel("old", 1000.0, 0.0, 0.01, 1e12)  # a cost model from before the host tier
    with pytest.raises(ValueError, match="no host_to_device_bytes_per_s"):
        make_sim(4 * DEVICE, cost=old)
    assert make_sim(0, cost=old).num_host_pages_per_group == ()  # fine without a tier


def test_cost_yaml_host_bandwidth_is_optional_but_positive(tmp_path):
    """Catches: old cost files no longer loading, the shipped models losing their figure, a zero or
    non-numeric bandwidth accepted."""
    for name in ("gpu", "cpu"):
        assert load_cost_model(name).host_to_device_bytes_per_s > 0
    assert load_cost_model("gpu").host_to_device_bytes_per_s == 2.5e10
    base = "prefill_tokens_per_s: 1\n  prefill_overhead_s: 0\n  decode_step_s: 0\n  transfer_bytes_per_s: 1\n"
    path = tmp_path / "cost.yaml"
    path.write_text("old:\n  " + base)
    assert load_cost_model("old", path).host_to_device_bytes_per_s is None
    for bad, message in (("0", "throughputs must be positive"), ("fast", "missing or bad field")):
        path.write_text(f"m:\n  {base}  host_to_device_bytes_per_s: {bad}\n")
        with pytest.raises(SimConfigError, match=message):
            load_cost_model("m", path)


def test_cli_host_flags_parse_and_reach_the_replicas(tmp_path, capsys):
    """Catches: the flags missing or not passed to SimSettings (the summary's host budget and
    pages), a negative value not refused with exit code 2."""
    assert build_parser().parse_args([]).host_memory_gib == 0.0
    assert build_parser().parse_args(["--host-memory-gib", "2.5"]).host_memory_gib == 2.5
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]}) + "\n")
    out = tmp_path / "s.json"
    assert main(["--trace", str(trace), "--replicas", "1", "--memory-gib", "1", "--host-memory-gib", "4",
                 "--out", str(out), "--no-progress"]) == 0
    summary = json.loads(out.read_text())
    assert summary["host_bytes_per_replica"] == 4 * 2**30
    # nemotron-nano-9b-v2: 1 MiB KV blocks, 72,769,536 B states, a quarter of the bytes for states
    assert summary["num_host_pages_per_group"] == [3 * 2**30 // 2**20, 2**30 // 72_769_536]
    capsys.readouterr()
    assert main(["--trace", str(trace), "--host-memory-gib", "-1", "--no-progress"]) == 2
    assert "--host-memory-gib must be >= 0" in capsys.readouterr().err
    assert main(["--trace", str(trace), "--host-memory-share", "0", "--no-progress"]) == 2
    assert "--host-memory-share must be positive" in capsys.readouterr().err
