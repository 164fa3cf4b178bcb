"""`hybridserve gen-trace`: seeded, Mooncake-readable multi-turn traces whose next turn extends the
previous prompt and output (block ids equal exactly over the shared full blocks, new past them),
whose sessions share system prompts by a branching tree, and on which the hybrid router keeps its
share of the oracle's hits."""

from __future__ import annotations

from collections import defaultdict

import pytest

from cache_service.trace_sim.config import load_cost_model, load_layout
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.generate import BlockIds, GenConfig, generate, main
from cache_service.trace_sim.trace import load_trace


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_block_ids_are_equal_exactly_for_equal_prefixes():
    ids = BlockIds()
    a = ids.of([(1, 700)])  # 512 + 188
    b = ids.of([(1, 700), (2, 400)])  # the same 700 tokens, then 400 more: 1100 = 512 + 512 + 76
    c = ids.of([(1, 512), (3, 188)])  # the same first block, other text after it
    d = ids.of([(1, 700)])
    assert len(a) == 2 and len(b) == 3 and a == d
    assert b[0] == a[0] and b[1] != a[1]  # the partial block that the new text extends is a new block
    assert c[0] == a[0] and c[1] != a[1]
    assert len(set(a + b + c)) == 5


@pytest.mark.parametrize("workload", ["chat", "agent", "mixed"])
def test_each_turn_extends_the_previous_prompt_and_output(workload):
    records = generate(GenConfig(workload=workload, num_sessions=12, seed=3))
    by_session = defaultdict(list)
    for r in records:
        assert len(r["hash_ids"]) == -(-r["input_length"] // 512)
        by_session[r["session"]].append(r)
    assert {r["workload"] for r in records} == ({"chat", "agent"} if workload == "mixed" else {workload})
    num_multi = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        assert [t["turn"] for t in turns] == list(range(len(turns)))
        for prev, nxt in zip(turns, turns[1:]):
            shared = prev["input_length"] + prev["output_length"]
            assert nxt["input_length"] > shared and nxt["timestamp"] >= prev["timestamp"]
            assert _common_prefix(prev["hash_ids"], nxt["hash_ids"]) == prev["input_length"] // 512
            num_multi += 1
    assert num_multi > 10
    assert [r["timestamp"] for r in records] == sorted(r["timestamp"] for r in records)
    assert generate(GenConfig(workload=workload, num_sessions=12, seed=3)) == records
    assert generate(GenConfig(workload=workload, num_sessions=12, seed=4)) != records


def test_sessions_share_system_prompts_across_the_tree():
    records = generate(GenConfig(workload="mixed", num_sessions=40, seed=1))
    firsts = [r for r in records if r["turn"] == 0]
    agents = [r["hash_ids"] for r in firsts if r["workload"] == "agent"]
    chats = [r["hash_ids"] for r in firsts if r["workload"] == "chat"]
    assert all(_common_prefix(agents[0], a) == 2500 // 512 for a in agents[1:])  # the shared tool prompt
    shared = [_common_prefix(a, b) for i, a in enumerate(chats) for b in chats[i + 1:]]
    assert max(shared) >= 2 and min(shared) == 0  # some sessions share a base prompt, others do not


def test_cli_writes_a_trace_the_simulator_reads_and_hybrid_routing_keeps_the_oracles_hits(tmp_path, capsys):
    path = tmp_path / "conv.jsonl.gz"
    assert main(["--workload", "mixed", "--sessions", "24", "--seed", "2", "--out", str(path)]) == 0
    assert "24 sessions" in capsys.readouterr().out
    requests = load_trace(path)
    assert len(requests) == len(generate(GenConfig(num_sessions=24, seed=2)))
    layout, cost = load_layout("nemotron-nano-9b-v2"), load_cost_model("gpu")
    hits = {}
    for policy in ("hybrid", "round_robin", "oracle"):
        sim = ClusterSim(SimSettings(layout, cost, 4, policy, 40 * 2**30))
        hits[policy] = sum(r.hit_tokens for r in sim.run(requests))
    assert hits["oracle"] >= hits["hybrid"] >= 0.95 * hits["oracle"] > hits["round_robin"] > 0


def test_bad_arguments_are_clear_errors(capsys):
    with pytest.raises(SystemExit):
        main(["--sessions", "0"])
    assert "sessions must be >= 1" in capsys.readouterr().err
