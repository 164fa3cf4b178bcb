"""`hybridserve loadtest trace`: a scaled slice of a Mooncake trace as a workload (no server here;
tests/sim/test_live_validation.py sends such a slice through a live cluster)."""

import json

import pytest

from cache_service.trace_sim.cli import DEFAULT_TRACE
from cache_service.trace_sim.trace import TraceError, load_trace
from cluster.loadtest.__main__ import main
from cluster.loadtest.workloads import WorkloadConfig, build_workload


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_blocks_are_scaled_shared_ids_share_prefixes_and_arrivals_scale(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1024, "output_length": 50, "hash_ids": [7, 8]},
        {"timestamp": 3000, "input_length": 1300, "output_length": 2, "hash_ids": [7, 8, 9]},
        {"timestamp": 5000, "input_length": 700, "output_length": 3, "hash_ids": [4, 5]},
        {"timestamp": 9000, "input_length": 5000, "output_length": 3, "hash_ids": list(range(20, 30))},
    ])
    config = WorkloadConfig("trace", trace=trace, scale=1 / 16, time_scale=2.0, max_tokens=8, max_model_len=200,
                            salt="")
    specs = build_workload(config).specs
    # 32 tokens per block; the partial last block in proportion: 276 / 512 * 32 -> 17; 188 -> 12;
    # 10 blocks (320 tokens) cut to max_model_len - max_tokens = 192
    assert [len(s.prompt) for s in specs] == [64, 81, 44, 192]
    assert specs[1].prompt[:64] == specs[0].prompt  # ids 7, 8 shared exactly
    assert specs[2].prompt[0] != specs[0].prompt[0] or specs[2].prompt[:32] != specs[0].prompt[:32]
    assert [s.arrival_s for s in specs] == [0.0, 1.0, 2.0, 4.0]  # from the first arrival, halved
    assert [s.phase for s in specs] == ["cold", "warm", "cold", "cold"]
    assert [s.max_tokens for s in specs] == [8, 2, 3, 3]  # min(output_length, --max-tokens)
    assert all(3 <= t <= 258 for s in specs for t in s.prompt)  # byte-tokenizer ids
    assert build_workload(config).specs == specs  # deterministic


def test_the_shipped_trace_slice_is_the_simulators_slice():
    """The loadtest and `simulate --scale` see the same lengths and ids (the validation relies on it)."""
    from cluster.loadtest.trace_workload import trace_slice

    config = WorkloadConfig("trace", trace=str(DEFAULT_TRACE), trace_start=100, trace_limit=20, scale=1 / 32,
                            max_tokens=4, max_model_len=2048, salt="")
    specs = build_workload(config).specs
    sliced = trace_slice(str(DEFAULT_TRACE), 100, 20, 1 / 32, 1.0, 2044)
    assert [len(s.prompt) for s in specs] == [r.input_length for r in sliced]
    assert [r.hash_ids[0] for r in sliced] == [r.hash_ids[0] for r in load_trace(DEFAULT_TRACE, 120)[100:]]


def test_bad_trace_inputs_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="needs --trace FILE"):
        WorkloadConfig("trace")
    with pytest.raises(TraceError, match="--scale must be in"):
        build_workload(WorkloadConfig("trace", trace=str(DEFAULT_TRACE), scale=2.0))
    assert main(["trace", "--trace", str(tmp_path / "missing.jsonl"), "--url", "http://127.0.0.1:9"]) == 2
    assert main(["trace", "--trace", str(DEFAULT_TRACE), "--time-scale", "0", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "trace file not found" in err and "--time-scale must be positive" in err
    assert "no server at" not in err  # rejected before any server is contacted
