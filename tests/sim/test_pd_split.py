"""The stepped decode model and prefill/decode disaggregation (issue 31): hand-computed token times
on a mixed replica (a long prompt stalls the decodes sharing its steps) and on a 1:1 split (it
does not), hand-off bytes from the page model, the decode replica's choice, every request
finishing on a shipped-trace slice, and the CLI's checks."""

from __future__ import annotations

import json
from array import array

import pytest

from cache_service.specs import CacheLayout, parse_group_spec
from cache_service.trace_sim import step_timeline
from cache_service.trace_sim.cli import DEFAULT_TRACE, main
from cache_service.trace_sim.config import CostModel, SimLayout, load_cost_model, load_layout
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.pd_split import PdSplit, handoff_bytes
from cache_service.trace_sim.step_timeline import RequestTiming, StepTimeline
from cache_service.trace_sim.stepped_engine import SteppedClusterSim
from cache_service.trace_sim.trace import TraceRequest, load_trace

# a step of D decodes: 0.008 + 0.002 D s; 1,024 tokens a step; prefill 1 ms a token; 1 MB/s links
COST = CostModel("test", prefill_tokens_per_s=1000.0, prefill_overhead_s=0.0, decode_step_s=0.008,
                 transfer_bytes_per_s=1e6, decode_per_seq_s=0.002, step_token_budget=1024)
LAYOUT = SimLayout("test", CacheLayout((parse_group_spec("full:64"), parse_group_spec("mamba:64"))), (1000, 4000))


def request(index: int, arrival_s: float, hash_ids: list[int], input_length: int, output: int) -> TraceRequest:
    return TraceRequest(index, arrival_s, input_length, output, tuple(hash_ids))


def stepped(replicas: int, split: str | None = None, cost: CostModel = COST, layout: SimLayout = LAYOUT,
            policy: str = "hybrid") -> SteppedClusterSim:
    return SteppedClusterSim(SimSettings(layout, cost, replicas, policy, 10**8, mamba_fraction=0.5,
                                         decode_model="stepped",
                                         pd_split=PdSplit.parse(split) if split else None))


def gaps(record) -> tuple[float, float]:
    return record.mean_itl_s, record.max_itl_s


# A: 400 tokens at 0 (prefill 0.4 s), 10 output tokens; B: 2,048 other tokens at 0.455, 3 output tokens
STALL_TRACE = [request(0, 0.0, [0], 400, 10), request(1, 0.455, [1, 2, 3, 4], 2048, 3)]


def test_mixed_replica_a_long_prompt_stalls_the_decode_it_shares_steps_with():
    """One mixed replica. A's first token at 0.4; its decode steps (one sequence: 0.010 s) end at
    0.41 .. 0.46 (tokens 2-7). B lands during the step [0.45, 0.46) and joins the next: the
    budget leaves 1,023 tokens beside A's decode, so two steps of 0.010 + 1.023 s stall A's tokens
    8 and 9, and the third (2 tokens: 0.012 s) ends B's prefill at 2.538 with A's last token.
    Catches: decode beside the prefill without interference (A's gaps all 0.01), chunks ignoring
    the decodes' share of the budget (1.024 s stalls), B joining the step already running."""
    a, b = stepped(1).run(STALL_TRACE)
    assert a.ttft_s == pytest.approx(0.4)
    assert a.num_itl == 9 and a.max_itl_s == pytest.approx(1.033)
    assert a.mean_itl_s == pytest.approx((6 * 0.010 + 2 * 1.033 + 0.012) / 9)
    assert a.finish_s == pytest.approx(2.538)
    assert b.ttft_s == pytest.approx(2.538 - 0.455)
    assert gaps(b) == pytest.approx((0.010, 0.010)) and b.finish_s == pytest.approx(2.558)
    assert a.decode_replica == b.decode_replica == -1 and a.handoff_bytes == 0


def test_split_one_to_one_the_same_prompt_does_not_stall_the_decode():
    """1 prefill + 1 decode replica. A's hand-off: 7 KV pages of 1,000 B + a 4,000 B state = 11 kB,
    0.011 s: TTFT 0.411, then nine 0.010 s steps alone on the decode replica. B prefills alone from
    0.455 (two full 1,024-token steps, 2.048 s), hands off 32 pages + the state (36 kB, 0.036 s).
    Catches: the hand-off left out of TTFT, decodes still sharing the prefill replica's steps, a
    hand-off priced from tokens instead of whole pages."""
    sim = stepped(2, "1:1")
    a, b = sim.run(STALL_TRACE)
    assert (a.replica, a.decode_replica, b.replica, b.decode_replica) == (0, 1, 0, 1)
    assert (a.handoff_bytes, b.handoff_bytes) == (11_000, 36_000)
    assert a.handoff_s == pytest.approx(0.011) and a.ttft_s == pytest.approx(0.411)
    assert gaps(a) == pytest.approx((0.010, 0.010)) and a.finish_s == pytest.approx(0.501)
    assert b.ttft_s == pytest.approx(2.048 + 0.036)
    assert gaps(b) == pytest.approx((0.010, 0.010)) and b.finish_s == pytest.approx(0.455 + 2.084 + 0.020)
    assert sim.num_handoff_bytes == 47_000
    assert sorted(sim.itl_samples) == pytest.approx([0.010] * 11)


def test_without_decodes_the_stepped_prefill_takes_the_legacy_queues_time():
    """Requests far apart on 2 mixed replicas, with a fixed overhead, hits and prompts over several
    chunks: TTFT equals the independent model's. Catches: the overhead paid per chunk instead of
    per prefill, the hit not subtracted, a chunk's tokens counted twice."""
    cost = CostModel("t", 1000.0, 0.005, 0.008, 1e6, decode_per_seq_s=0.002, step_token_budget=700)
    trace = [request(i, 20.0 * i, ids, n, 3) for i, (ids, n) in
             enumerate([([0, 1, 2], 1536), ([0, 1, 2, 3], 2000), ([5], 300), ([0, 1, 2], 1536)])]
    legacy = ClusterSim(SimSettings(LAYOUT, cost, 2, "hybrid", 10**8, mamba_fraction=0.5))
    want = [legacy.step(r) for r in trace]
    got = stepped(2, cost=cost).run(trace)
    assert [r.hit_tokens for r in got] == [r.hit_tokens for r in want] == [0, 1536, 0, 1472]
    assert [r.ttft_s for r in got] == pytest.approx([r.ttft_s for r in want])


def test_handoff_bytes_follow_the_page_model_with_the_draft_group():
    """nemotron-3-moe-mtp: full and draft KV pages per 64 tokens, one Mamba state. Catches: the
    draft (MTP) pages or the partial last block left out, held pages not subtracted."""
    layout = load_layout("nemotron-3-moe-mtp")
    kv, state, draft = layout.page_bytes
    assert handoff_bytes(layout, 1000, 0) == 16 * (kv + draft) + state
    assert handoff_bytes(layout, 1000, 640) == 6 * (kv + draft) + state
    assert handoff_bytes(layout, 1024, 5000) == state


def test_the_decode_replica_with_fewer_streams_wins_then_the_one_holding_the_prefix():
    """1 prefill + 2 decode replicas. B is handed to replica 1 (both idle: the lower id); A, with
    B's 199 tokens queued there when A's prefill ends, goes to replica 2. Later C extends A's prompt: both are
    idle, replica 2 published A's hand-off and holds 1,024 tokens of C's KV, so C goes there and
    moves 8 pages + the state, not 24 + the state. Catches: the decode replica chosen by index
    only, the receiver not publishing to the index, the hand-off ignoring what the receiver holds."""
    trace = [request(0, 0.0, [7], 512, 200), request(1, 0.01, [0, 1], 1024, 200),
             request(2, 60.0, [0, 1, 2], 1536, 3)]
    b, a, c = stepped(3, "1:2").run(trace)
    assert (b.decode_replica, a.decode_replica) == (1, 2)
    assert c.decode_replica == 2
    assert c.handoff_bytes == 8 * 1000 + 4000 < handoff_bytes(LAYOUT, 1536, 0) == 24 * 1000 + 4000


def test_the_decode_choice_is_the_serving_paths_pages_against_queued_tokens():
    """1 prefill + 2 decode replicas; A (1,024 tokens, 300 outputs) decodes on replica 1, then C
    extends A's prompt. Holding A's 1,024 tokens is worth 0.05 x 1,024 = 51.2 queued tokens
    (`decode_placement`, the router's units): C's hand-off at 3.43 s finds A with about 60 tokens
    left and goes to the idle replica 2 (28 pages' worth); at 3.61 s A has about 41 left and C goes
    to replica 1 beside it, moving 12 kB instead of 28 kB. Catches: the old rule (fewest streams
    first: replica 2 both times), a placement blind to load (replica 1 both times)."""
    def place(arrival_s: float):
        trace = [request(0, 0.0, [0, 1], 1024, 300), request(1, arrival_s, [0, 1, 2], 1536, 3)]
        a, c = stepped(3, "1:2").run(trace)
        assert a.decode_replica == 1 and a.finish_s > arrival_s + c.ttft_s  # A still decoding then
        return c.decode_replica, c.handoff_bytes

    assert place(2.9) == (2, handoff_bytes(LAYOUT, 1536, 0))
    assert place(3.1) == (1, handoff_bytes(LAYOUT, 1536, 1024))


def test_fast_forwarded_decode_steps_equal_one_by_one(monkeypatch):
    """A decode replica with streams joining mid-run, advanced in pieces: the same token times
    with and without taking pure-decode runs at once. Catches: a run stepping past a join or past
    `until`, a stream's tokens miscounted there."""
    def run() -> tuple[list, list[float]]:
        itl = array("d")
        timeline = StepTimeline(COST, "decode", itl)
        timings = [RequestTiming(i, 0.0, n) for i, n in enumerate((30, 7, 12, 2))]
        for t, lands in zip(timings, (0.0, 0.0731, 0.074, 0.2)):
            t.first_token_s = t.last_token_s = lands
            timeline.admit_stream(lands, t)
        for until in (0.05, 0.0731, 0.15, 0.3, float("inf")):
            timeline.advance(until)
        return [x for t in timings for x in (t.last_token_s, t.num_itl, t.max_itl_s)], sorted(itl)

    fast = run()
    monkeypatch.setattr(step_timeline.StepTimeline, "_fast_forward", lambda self, until: False)
    slow = run()
    assert fast[0][1::3] == [29, 6, 11, 1]
    assert fast[0] == pytest.approx(slow[0]) and fast[1] == pytest.approx(slow[1])


@pytest.mark.parametrize("split", [None, "3:1"])
def test_every_request_of_a_shipped_slice_finishes_with_all_its_tokens(split):
    """Catches: a stream lost at a hand-off or a fast-forward, a request never decoded, ITL
    samples not one per token after the first."""
    requests = load_trace(DEFAULT_TRACE, limit=120)
    sim = SteppedClusterSim(SimSettings(load_layout("nemotron-nano-9b-v2"), load_cost_model("gpu"), 4, "hybrid",
                                        20 * 2**30, decode_model="stepped",
                                        pd_split=PdSplit.parse(split) if split else None))
    records = sim.run(requests)
    assert [r.index for r in records] == [r.index for r in requests]
    assert all(r.num_itl == r.output_tokens - 1 and r.finish_s >= r.arrival_s + r.ttft_s for r in records)
    assert len(sim.itl_samples) == sum(r.output_tokens - 1 for r in records)
    if split:
        assert {r.replica for r in records} <= {0, 1, 2} and {r.decode_replica for r in records} == {3}
        assert sim.num_handoff_bytes == sum(r.handoff_bytes for r in records) > 0


def test_cli_reports_latencies_and_refuses_bad_splits(tmp_path, capsys):
    """Catches: the stepped summary missing, a split not adding up to --replicas, the oracle
    (one shared cache) accepted with roles, the default run growing stepped keys."""
    out = tmp_path / "s.json"
    assert main(["--limit", "40", "--replicas", "4", "--pd-split", "3:1", "--no-progress", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["pd_split"] == "3:1" and summary["num_finished"] == 40
    assert 0 < summary["itl_s"]["p50"] <= summary["itl_s"]["p90"] <= summary["itl_s"]["p99"]
    assert main(["--limit", "40", "--replicas", "4", "--no-progress", "--out", str(out)]) == 0
    assert "itl_s" not in json.loads(out.read_text())
    capsys.readouterr()
    assert main(["--limit", "5", "--replicas", "4", "--pd-split", "3:2", "--no-progress"]) == 2
    assert "has 5 replicas, --replicas is 4" in capsys.readouterr().err
    assert main(["--limit", "5", "--replicas", "2", "--pd-split", "1:1", "--policy", "oracle", "--no-progress"]) == 2
    assert "oracle" in capsys.readouterr().err
    assert main(["--limit", "5", "--pd-split", "x", "--no-progress"]) == 2
    assert "P:D" in capsys.readouterr().err
