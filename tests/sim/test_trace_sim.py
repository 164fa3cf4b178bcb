"""Trace-driven simulation: exact hits on hand-built traces, publication timing, eviction,
junctions, routing, oracle bounds on the shipped trace, the CLI and clear errors."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from cache_service.router import RouterConfig
from cache_service.specs import CacheLayout, parse_group_spec
from cache_service.trace_sim.cli import DEFAULT_TRACE, main
from cache_service.trace_sim.config import CostModel, SimLayout, load_cost_model, load_layout
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.policies import POLICY_NAMES
from cache_service.trace_sim.trace import TraceError, TraceRequest, load_trace

COST = CostModel("test", prefill_tokens_per_s=1000.0, prefill_overhead_s=0.0, decode_step_s=0.01,
                 transfer_bytes_per_s=1e12)
LAYOUT = SimLayout("test", CacheLayout((parse_group_spec("full:64"), parse_group_spec("mamba:64"))), (1000, 4000))


def make_request(index: int, arrival_s: float, hash_ids: list[int], input_length: int | None = None) -> TraceRequest:
    n = len(hash_ids) * 512 if input_length is None else input_length
    return TraceRequest(index, arrival_s, n, 4, tuple(hash_ids))


def make_sim(policy: str = "hybrid", replicas: int = 2, budget: int = 10**8, retention: str = "latest") -> ClusterSim:
    return ClusterSim(SimSettings(LAYOUT, COST, replicas, policy, budget, retention=retention, mamba_fraction=0.5))


def test_tokens_follow_hash_ids_and_cut_the_last_block():
    a = make_request(0, 0.0, [3, 7], 600).tokens()
    b = make_request(1, 0.0, [3, 8], 1024).tokens()
    assert len(a) == 600 and len(b) == 1024
    assert a[:512] == b[:512] and a[512] != b[512]
    assert a[0] == 3 * 512 + 1


def test_shared_prefix_hits_exactly_the_published_blocks_and_ttft_follows():
    sim = make_sim()
    first = sim.step(make_request(0, 0.0, [0, 1]))  # 1024 tokens: snapshots at 960 and 1024
    second = sim.step(make_request(1, 10.0, [0, 1, 2]))
    assert first.hit_tokens == 0 and first.ttft_s == pytest.approx(1.024)
    assert second.hit_tokens == 1024 and second.replica == first.replica
    assert second.ttft_s == pytest.approx(0.512)  # (1536 - 1024) tokens at 1000 tokens/s
    resend = sim.step(make_request(2, 20.0, [0, 1]))
    assert resend.hit_tokens == 960  # the replay boundary floor(1023 / 64) * 64


def test_nothing_hits_before_the_prefill_that_stores_it_ends():
    sim = make_sim(replicas=1)
    sim.step(make_request(0, 0.0, [0, 1]))  # prefill ends at 1.024 s
    early = sim.step(make_request(1, 0.5, [0, 1, 2]))
    assert early.hit_tokens == 0
    assert early.ttft_s == pytest.approx(1.024 - 0.5 + 1.536)  # queued behind the first prefill


def test_round_robin_misses_what_the_hybrid_router_finds():
    sim = make_sim("round_robin")
    sim.step(make_request(0, 0.0, [0, 1]))
    second = sim.step(make_request(1, 10.0, [0, 1, 2]))
    assert second.replica == 1 and second.hit_tokens == 0


def test_eviction_in_the_real_pools_loses_the_prefix():
    # 17 KV blocks (16 usable + null) and 5 state pages: one 1024-token request fits, two do not
    tight = make_sim(replicas=1, budget=2 * 17_000)
    tight.step(make_request(0, 0.0, [0, 1]))
    tight.step(make_request(1, 10.0, [5, 6]))
    assert tight.step(make_request(2, 20.0, [0, 1])).hit_tokens == 0
    roomy = make_sim(replicas=1)
    roomy.step(make_request(0, 0.0, [0, 1]))
    roomy.step(make_request(1, 10.0, [5, 6]))
    assert roomy.step(make_request(2, 20.0, [0, 1])).hit_tokens == 960


def test_a_junction_snapshot_lets_the_next_sibling_hit_and_routing_finds_it():
    sim = make_sim("hybrid", replicas=2)
    a = sim.step(make_request(0, 0.0, [0, 1, 2]))
    b = sim.step(make_request(1, 10.0, [0, 1, 5]))  # matches 1024 tokens of KV, no snapshot there
    c = sim.step(make_request(2, 20.0, [0, 1, 7]))
    assert (a.hit_tokens, b.hit_tokens) == (0, 0)
    assert b.attention_match_tokens == 1024 and b.replica == a.replica
    assert c.hit_tokens == 1024 and c.replica == b.replica


def test_oracle_bounds_every_policy_on_the_shipped_trace():
    requests = load_trace(DEFAULT_TRACE, limit=300)
    assert len(requests) == 300 and requests[0].input_length == 40160
    layout = load_layout("nemotron-nano-9b-v2")
    hits = {}
    for policy in POLICY_NAMES:
        sim = ClusterSim(SimSettings(layout, load_cost_model("gpu"), 4, policy, 20 * 2**30))
        hits[policy] = sum(r.hit_tokens for r in sim.run(requests))
    assert hits["oracle"] > 0
    assert all(hits["oracle"] >= h for h in hits.values()), hits
    assert hits["round_robin"] < hits["oracle"]


def test_cli_writes_summary_and_parquet(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
             {"timestamp": 10000, "input_length": 1536, "output_length": 3, "hash_ids": [0, 1, 2]}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out, parquet, plot = tmp_path / "s.json", tmp_path / "r.parquet", tmp_path / "p.png"
    rc = main(["--trace", str(trace), "--replicas", "2", "--policy", "all", "--memory-gib", "1",
               "--out", str(out), "--parquet", str(parquet), "--plot", str(plot), "--no-progress"])
    assert rc == 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    summary = json.loads(out.read_text())["policies"]
    assert summary["hybrid"]["num_hit_tokens"] == 1024 and summary["oracle"]["num_hit_tokens"] == 1024
    assert summary["round_robin"]["num_hit_tokens"] == 0 and summary["hybrid"]["hit_tokens_vs_oracle"] == 1.0
    table = pq.read_table(parquet).to_pylist()
    assert len(table) == 2 * len(POLICY_NAMES)
    assert [r["hit_tokens"] for r in table if r["policy"] == "hybrid"] == [0, 1024]


def test_bad_inputs_give_clear_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [0]}) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:1: 1 hash ids for 1024 tokens"):
        load_trace(bad)
    assert main(["--trace", str(tmp_path / "missing.jsonl"), "--no-progress"]) == 2
    assert main(["--trace", str(bad), "--layout", "nope", "--no-progress"]) == 2
    assert main(["--trace", str(bad), "--policy", "nope", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "trace file not found" in err and "unknown policy 'nope'" in err


@pytest.mark.parametrize(("eagle", "expected"), [("off", 1024), ("lossless", 1024), ("drop", 960)])
def test_eagle_mode_reaches_the_simulated_hit(eagle, expected):
    # drop (lookahead): 1024 needs the block [1024, 1088) cached to prove the successor token; it
    # is not (the second request's third block differs), so the hit lands on the snapshot at 960
    sim = ClusterSim(SimSettings(LAYOUT, COST, 1, "hybrid", 10**8, eagle=eagle, mamba_fraction=0.5))
    sim.step(make_request(0, 0.0, [0, 1]))
    assert sim.step(make_request(1, 10.0, [0, 1, 2])).hit_tokens == expected


@pytest.mark.parametrize(("name", "expected", "resend_hit"), [
    # 30 GiB / 1 MiB; 10 GiB / 72,769,536 B. Resend of 3,072 tokens with EAGLE drop: the replay
    # boundary floor(3071/64)*64 = 3008, and the lookahead block [3008, 3072) is cached
    ("nemotron-nano-9b-v2", (30720, 147), 3008),
    ("nemotron-3-moe-mtp", (70217, 430, 70217), 3008),  # 30 GiB / (393,216 + 65,536 B); 10 GiB / 24,965,120 B
    ("glm-like-seed", (30720, 142, 142, 142), 2304),  # 10 GiB / (3 x 25,165,824 B); A = 2304, block [2304, 2368) cached
])
def test_shipped_layouts_size_pools_from_page_bytes(name, expected, resend_hit):
    layout = load_layout(name)
    assert layout.pool_blocks(40 * 2**30, 0.25) == expected
    sim = ClusterSim(SimSettings(layout, COST, 1, "hybrid", 40 * 2**30, eagle="drop"))
    sim.step(make_request(0, 0.0, [0, 1, 2, 3, 4, 5]))
    assert sim.step(make_request(1, 10.0, [0, 1, 2, 3, 4, 5])).hit_tokens == resend_hit


def test_load_is_what_a_replica_reports_prefill_then_decode_left():
    sim = make_sim("hybrid", replicas=2)
    a = sim.step(make_request(0, 0.0, [0, 1]))  # prefill 1024 tokens until 1.024 s, 4 decode steps to 1.064
    queue = sim.queues[a.replica]
    assert queue.queued_tokens(0.0) == 1024 + 0 and queue.queued_tokens(0.5) == 1024 - 500
    b = sim.step(make_request(1, 0.5, [5, 6]))  # no shared prefix: the idle replica wins
    assert b.replica != a.replica
    assert queue.queued_tokens(1.044) == 2 and queue.num_in_flight(1.044) == 1  # decode steps left
    assert queue.queued_tokens(1.064) == 0 and queue.num_in_flight(1.064) == 0


@pytest.mark.parametrize(("credit", "sibling_replica", "third_hit"), [(0.5, "holder", 512), (0.0, "other", 0)])
def test_the_junction_credit_keeps_a_sibling_on_the_kv_holder_so_the_next_one_hits(credit, sibling_replica,
                                                                                   third_hit):
    """Latest retention: the first request leaves KV for [0, 1024) and snapshots at 960 and 1024.
    A sibling sharing block 0 hits nothing anywhere (no snapshot at 512); the holder is 1 token
    busier (decode left). Credited, the sibling goes there and snapshots the junction at 512,
    which the third sibling hits; without the credit it goes by load and no junction forms."""
    sim = ClusterSim(SimSettings(LAYOUT, COST, 2, "hybrid", 10**8, mamba_fraction=0.5,
                                 router=RouterConfig(junction_credit=credit)))
    first = sim.step(make_request(0, 0.0, [0, 1]))
    assert sim.queues[first.replica].queued_tokens(1.05) == 1
    second = sim.step(make_request(1, 1.05, [0, 5]))
    assert (second.hit_tokens, second.attention_match_tokens if second.replica == first.replica else 512) == (0, 512)
    assert (second.replica == first.replica) == (sibling_replica == "holder")
    third = sim.step(make_request(2, 20.0, [0, 9]))
    assert third.hit_tokens == third_hit


def test_memoised_trace_hashes_equal_the_block_hash_code_on_the_shipped_trace():
    from cache_service.block_hash import RequestBlockHashes
    from cache_service.trace_sim.hashing import TraceHasher

    requests = load_trace(DEFAULT_TRACE, limit=150)
    hasher = TraceHasher(64)
    for req in requests + requests[::7]:  # cold, then warm (memoised) blocks
        got, want = hasher.hashes(req), RequestBlockHashes(64, req.tokens())
        assert got.hashes == want.hashes and got.num_tokens == want.num_tokens == req.input_length


def test_the_index_mirrors_every_replicas_pools_after_a_run_with_evictions():
    """Publication goes through the pools and the wire records into the real index: after a run
    that evicts, each replica's entries in the index are exactly its pools' cached hashes."""
    requests = load_trace(DEFAULT_TRACE, limit=120)
    layout = load_layout("nemotron-nano-9b-v2")
    sim = ClusterSim(SimSettings(layout, load_cost_model("gpu"), 3, "hybrid", 2 * 2**30))
    sim.run(requests)
    assert sum(c.num_refused_prefills for c in sim.caches) == 0
    for cache in sim.caches:
        bit = 1 << sim.index.replicas[cache.replica_id].bit
        for g, pool in enumerate(cache.cache.pools):
            in_index = {k for k, mask in sim.index.holders[g].items() if mask & bit}
            assert in_index == set(pool.cached)
        cache.cache.check_integrity()
        # every replica published more KV blocks than its pool holds (1,536 blocks of 1 MiB for
        # ~28K blocks of prompts): eviction events ran
        assert cache.num_stored_blocks[0] > cache.cache.pools[0].num_blocks


@pytest.mark.parametrize("policy", ["hybrid", "attention_overlap"])
def test_seed_drives_the_routers_tie_breaks(policy):
    """`simulate --seed` reaches the cluster router: on an idle cluster every replica costs the
    same, so the seeded tie-break alone places each new prompt. Equal seeds place alike; across
    seeds the placements differ (the router once ignored the seed: every seed placed as seed 0)."""
    def placements(seed: int) -> list[int]:
        sim = ClusterSim(SimSettings(LAYOUT, COST, 8, policy, 10**7, mamba_fraction=0.5, seed=seed))
        return [sim.step(make_request(i, 100.0 * i, [1000 + i])).replica for i in range(12)]

    runs = {seed: placements(seed) for seed in range(4)}
    assert placements(2) == runs[2]
    assert len({tuple(p) for p in runs.values()}) == 4



def test_the_oracle_pools_the_host_tier_of_every_replica_too():
    """The oracle's one cache gets R x the per-replica device budget and R x the host tier
    (`bench.routing_pressure --host-share` compares against it); a routed replica gets one share."""
    def pools(policy: str) -> tuple[list[int], list[int]]:
        cost = CostModel("test", 1000.0, 0.0, 0.01, transfer_bytes_per_s=1e12, host_to_device_bytes_per_s=1e11)
        sim = ClusterSim(SimSettings(LAYOUT, cost, 4, policy, 10**7, mamba_fraction=0.5, host_bytes=10**7))
        return list(sim.num_blocks_per_group), list(sim.num_host_pages_per_group)

    (device, host), (oracle_device, oracle_host) = pools("hybrid"), pools("oracle")
    assert (device, host) == (list(LAYOUT.pool_blocks(10**7, 0.5)), list(LAYOUT.host_pages(10**7, 0.5)))
    assert oracle_device == list(LAYOUT.pool_blocks(4 * 10**7, 0.5))
    assert oracle_host == list(LAYOUT.host_pages(4 * 10**7, 0.5))
    assert min(host) > 0 and all(o > h for o, h in zip(oracle_host, host))


def test_value_auto_reports_what_its_pools_learned(tmp_path):
    """`simulate --eviction all` runs `value:auto` beside the others; its summary says what T and
    admission bias the pools learned and how many evictions they regretted (under pressure: some);
    the other policies' summaries carry no such field."""
    out = tmp_path / "s.json"
    rc = main(["--trace", str(DEFAULT_TRACE), "--limit", "400", "--replicas", "1", "--memory-share", "0.1",
               "--time-scale", "0.0625", "--eviction", "all", "--out", str(out), "--no-progress"])
    assert rc == 0
    runs = json.loads(out.read_text())["policies"]
    assert set(runs) == {"hybrid/lru", "hybrid/marconi", "hybrid/value", "hybrid/value:auto"}
    learned = runs["hybrid/value:auto"]["value_auto"]
    assert learned["num_regrets"] > 0
    assert 0.25 <= learned["t"]["min"] <= learned["t"]["median"] <= learned["t"]["max"] <= 64
    assert learned["t"]["min"] != 2.0 or learned["bias"]["max"] > 0  # something moved
    assert all("value_auto" not in s for name, s in runs.items() if name != "hybrid/value:auto")
