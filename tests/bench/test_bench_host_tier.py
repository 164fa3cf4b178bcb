"""`python -m bench.host_tier` end to end on a trace prefix, its table on hand-made rows, and its
argument errors."""

import json

import pyarrow.parquet as pq

from bench.host_tier import main, markdown


def row(share, ratio, hits, host_hits=0, trace="t"):
    return {"trace": trace, "replicas": 16, "share": share, "host_ratio": ratio, "num_hit_tokens": hits,
            "hit_rate": hits / 1000, "num_host_hit_tokens": host_hits, "num_promoted_bytes": host_hits * 2**20,
            "ttft_p50_s": 0.5, "ttft_p90_s": 1.25, "num_refused_prefills": 0}


def test_both_cells_run_on_both_traces_at_equal_device_memory(capsys, tmp_path):
    """Catches: a cell or trace dropped, the host cell not getting 4x the device bytes (or its
    device bytes changing), host hits exceeding hits, the table or the Parquet rows missing cells."""
    md, parquet = tmp_path / "table.md", tmp_path / "rows.parquet"
    assert main(["--limit", "60", "--jobs", "1", "--replicas", "2", "--shares", "0.25",
                 "--markdown", str(md), "--out", str(parquet)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {(r["trace"], r["host_ratio"]) for r in rows} == {(t, x) for t in ("shipped", "chat") for x in (0.0, 4.0)}
    for trace in ("shipped", "chat"):
        none, host = sorted((r for r in rows if r["trace"] == trace), key=lambda r: r["host_ratio"])
        assert none["budget_bytes_per_replica"] == host["budget_bytes_per_replica"] > 0
        assert none["host_bytes_per_replica"] == 0
        assert abs(host["host_bytes_per_replica"] - 4 * host["budget_bytes_per_replica"]) <= 4
        assert none["num_host_hit_tokens"] == none["num_promoted_bytes"] == 0
        assert 0 <= host["num_host_hit_tokens"] <= host["num_hit_tokens"]
        assert host["ttft_p50_s"] <= host["ttft_p90_s"]
    text = md.read_text()
    for trace in ("shipped", "chat"):
        assert f"| {trace} | 2 | 0.25 | no host tier |" in text
        assert f"| {trace} | 2 | 0.25 | host = 4x device |" in text
    assert len(pq.read_table(parquet).to_pylist()) == 4


def test_table_lists_the_no_tier_cell_first_and_compares_hits_with_it():
    """Catches: `vs none` against the wrong cell (another share or trace), rows out of order."""
    table = markdown([row(0.5, 4.0, 600, 100), row(0.1, 4.0, 300, 200), row(0.1, 0.0, 200), row(0.5, 0.0, 500)])
    lines = [line for line in table.splitlines() if line.startswith("| t |")]
    assert lines == [
        "| t | 16 | 0.1 | no host tier | 200 | 0.2000 | 1.00 | 0 | 0.0 | 0.500 | 1.250 | 0 |",
        "| t | 16 | 0.1 | host = 4x device | 300 | 0.3000 | 1.50 | 200 | 0.2 | 0.500 | 1.250 | 0 |",
        "| t | 16 | 0.5 | no host tier | 500 | 0.5000 | 1.00 | 0 | 0.0 | 0.500 | 1.250 | 0 |",
        "| t | 16 | 0.5 | host = 4x device | 600 | 0.6000 | 1.20 | 100 | 0.1 | 0.500 | 1.250 | 0 |",
    ]


def test_bad_arguments_are_refused_with_a_message(capsys):
    """Catches: a negative host ratio or an unknown trace reaching the workers (a traceback)."""
    assert main(["--host-ratios", "0,-1"]) == 2
    assert "--host-ratios >= 0" in capsys.readouterr().err
    assert main(["--traces", "nope"]) == 2
    assert "unknown trace 'nope'" in capsys.readouterr().err
