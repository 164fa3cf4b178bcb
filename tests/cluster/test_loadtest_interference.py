"""`hybridserve loadtest interference`: decoding streams alone, then with long prompts arriving,
ITL per round; `--compare --axes pd --pd P:D` runs mixed replicas and a prefill/decode split of the
same count in one run. Unit: the workload's shape, the summary math, the variants. Heavy: both
variants against real Ray servers (1 mixed + 1 mixed vs 1 prefill + 1 decode), the report's
structure and the hand-offs; no timing is asserted."""

import json

import pyarrow.parquet as pq
import pytest

from cluster.loadtest.__main__ import main
from cluster.loadtest.compare import make_variants
from cluster.loadtest.interference_report import format_interference, summarize_interference
from cluster.loadtest.outputs import SCHEMA
from cluster.loadtest.prometheus import parse_prometheus
from cluster.loadtest.records import LoadTestResult, RequestRecord
from cluster.loadtest.workloads import WorkloadConfig, build_workload

SMALL = dict(streams=2, decode_tokens=6, long_prompts=2, prompt_len=512, question_len=16, max_tokens=2,
             long_gap_s=0.2)


def test_interference_workload_shape():
    config = WorkloadConfig("interference", salt="s-", **SMALL)
    wl = build_workload(config)
    assert wl == build_workload(config) and wl.min_concurrency == 2 + 2
    specs = wl.specs
    assert [(s.source, s.phase) for s in specs] == [("decode", "warmup")] * 2 + [("decode", "control")] * 2 \
        + [("decode", "interference")] * 2 + [("long", "cold")] * 2
    warmup, control, streams, longs = specs[:2], specs[2:4], specs[4:6], specs[6:]
    assert all(s.max_tokens == 6 and len(s.prompt) == 16 for s in (*warmup, *control, *streams))
    assert all(s.after == () for s in warmup) and all(s.after == (0, 1) for s in control)
    # the last round starts after every control stream; the long prompts arrive beside it, staggered
    assert all(s.after == (2, 3) for s in (*streams, *longs))
    assert [s.delay_s for s in longs] == [0.2, 0.4] and all(s.delay_s is None for s in specs[:6])
    assert all(len(s.prompt) == 512 and s.max_tokens == 2 for s in longs)
    assert len({s.prompt for s in specs}) == len(specs)  # no request can hit another's prefix
    with pytest.raises(ValueError, match="streams"):
        WorkloadConfig("interference", streams=0)


def _stream(index, phase, itl, source="decode", ttft=0.05, status="200"):
    return RequestRecord(index, source, phase, f"d{index}", 0, 16, len(itl) + 1, None, status=status, ttft_s=ttft,
                         latency_s=ttft + sum(itl), completion_tokens=len(itl) + 1, itl_s=list(itl))


def test_interference_summary_per_round():
    records = [_stream(0, "control", [0.01, 0.02]), _stream(1, "control", [0.03]), _stream(6, "warmup", [9.0]),
               _stream(2, "interference", [0.01, 0.2]), _stream(3, "interference", [0.4], status="timeout"),
               _stream(4, "cold", [], source="long", ttft=1.0), _stream(5, "cold", [], source="long", ttft=3.0)]
    metrics = parse_prometheus("hybridserve_handoffs_total 4.0\nhybridserve_handoffs_kept_total 1.0\n")
    s = summarize_interference(LoadTestResult("interference", "v", WorkloadConfig(), records, 2.0, metrics))
    assert (s.control.num_streams, s.control.num_samples) == (2, 3)
    assert s.control.tpot_p50_s == pytest.approx((0.015 + 0.03) / 2) and s.control.tpot_max_s == pytest.approx(0.03)
    assert s.control.p50_s == pytest.approx(0.02) and s.control.p99_s == pytest.approx(0.0298)
    assert s.interference.num_streams == 1 and s.interference.num_samples == 2  # the failed stream is left out
    assert s.interference.p99_s == pytest.approx(0.01 + 0.99 * 0.19)
    assert s.p99_ratio == pytest.approx(s.interference.p99_s / s.control.p99_s)
    assert s.tpot_ratio == pytest.approx(0.21 / 2 / 0.0225)  # the one ok stream: 0.21 s over 2 tokens
    assert (s.long_ttft_p50_s, s.long_ttft_p90_s) == (2.0, pytest.approx(2.8))
    assert (s.num_handoffs, s.num_handoffs_kept) == (4.0, 1.0) and s.num_ok == 6
    assert s.output_tokens_per_s == (3 + 2 + 2 + 3 + 1 + 1) / 2.0
    table = format_interference([s])
    assert "p99 ratio" in table and "4 (1)" in table
    none = summarize_interference(LoadTestResult("interference", "v", WorkloadConfig(), records[:2], 1.0, None))
    assert none.interference.p99_s is None and none.p99_ratio is None and none.num_handoffs is None


def test_pd_variants_hold_the_replica_count():
    mixed, pd = make_variants("configs/local.yaml", ("engine.max_model_len=4096",), ("pd",), pd=(2, 2))
    assert (mixed.name, pd.name) == ("hybrid/lossless/latest", "hybrid/lossless/latest/pd2:2")
    for v in (mixed, pd):
        assert v.overrides[0] == "engine.max_model_len=4096"
        assert {"cluster.num_replicas=4", "cluster.min_replicas=4", "cluster.max_replicas=4"} <= set(v.overrides)
    assert not any("cluster.pd" in o for o in mixed.overrides)
    assert {"cluster.pd.num_prefill=2", "cluster.pd.num_decode=2"} <= set(pd.overrides)
    from cluster.config_loader import load_config  # what the server will load

    assert load_config("configs/local.yaml", list(pd.overrides)).cluster.pd.num_decode == 2
    assert not load_config("configs/local.yaml", list(mixed.overrides)).cluster.pd.enabled
    with pytest.raises(ValueError, match="--pd"):
        make_variants("configs/local.yaml", (), ("pd",))
    with pytest.raises(ValueError, match="mixed replicas"):
        make_variants("configs/local.yaml", ("cluster.pd.num_prefill=1", "cluster.pd.num_decode=1"), ("pd",),
                      pd=(1, 1))


@pytest.mark.heavy
@pytest.mark.long  # ~50 s (two Ray servers): make long, not make test
@pytest.mark.timeout(180)
def test_mixed_vs_pd_in_one_run(tmp_path, capsys):
    # catches: an ITL never recorded (or the first token's gap counted), a round missing in either
    # variant, a pd variant whose requests never leave the prefill replica (no hand-off), a mixed
    # variant that hands off, a request lost or failed across the hand-off
    args = ["interference", "--compare", "--axes", "pd", "--pd", "1:1", "--no-progress", "--out", str(tmp_path),
            "--set", "engine.max_model_len=2048", "--set", "engine.num_spec_tokens=0",
            "--streams", "2", "--decode-tokens", "12", "--long-prompts", "2", "--prompt-len", "384",
            "--question-len", "16", "--max-tokens", "2", "--long-gap", "0.05"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "interference: decoding streams' ITL" in printed and "pd1:1" in printed
    table = pq.read_table(tmp_path / "records.parquet")
    assert table.schema == SCHEMA
    rows = table.to_pylist()
    variants = ["hybrid/lossless/latest", "hybrid/lossless/latest/pd1:1"]
    assert sorted({r["variant"] for r in rows}) == variants and len(rows) == 2 * 8
    assert all(r["status"] == "200" for r in rows)
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        for phase in ("control", "interference"):
            streams = [r for r in mine if r["source"] == "decode" and r["phase"] == phase]
            assert len(streams) == 2
            # at most one gap per token after the first (tokens that arrive together are one delivery)
            assert all(r["completion_tokens"] == 12 and len(r["itl_s"]) <= 11 for r in streams)
            assert all(g >= 0.001 for r in streams for g in r["itl_s"])
            assert all(sum(r["itl_s"]) <= r["latency_s"] - r["ttft_s"] for r in streams)
        longs = [r for r in mine if r["source"] == "long"]
        assert len(longs) == 2 and all(r["computed_tokens"] == 384 and r["ttft_s"] > 0 for r in longs)
    summary = {row["variant"]: row["interference"] for row in json.loads((tmp_path / "summary.json").read_text())}
    mixed, pd = summary[variants[0]], summary[variants[1]]
    for s in (mixed, pd):
        assert s["control"]["num_samples"] >= 1 and s["interference"]["num_samples"] >= 1
        assert s["p99_ratio"] is not None and s["tpot_ratio"] is not None and s["long_ttft_p50_s"] is not None
    assert mixed["num_handoffs"] == 0
    assert pd["num_handoffs"] == 8 and pd["num_handoffs_kept"] == 0  # every request decoded on the decode replica
    assert (tmp_path / "interference.png").stat().st_size > 10_000
