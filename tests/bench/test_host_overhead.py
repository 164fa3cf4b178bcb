"""bench/host_overhead.py: per decode step at most one would-be device sync (eager and through the graph
runner), and far fewer operator calls with decode graphs. Deterministic counts, not timings."""

import json

import pytest

from bench.host_overhead import count_steps, main


@pytest.mark.parametrize("k", [0, 3])
def test_at_most_one_sync_per_decode_step_at_c16(tiny_model, k):
    counts = count_steps(tiny_model, 16, k, 3)
    assert [c.num_syncs for c in counts] == [1, 1, 1]
    assert all(dict(c.sync_sites) == {"Tensor.tolist": 1} for c in counts)


def test_decode_graphs_leave_a_fixed_handful_of_host_calls(tiny_model):
    eager = count_steps(tiny_model, 16, 0, 2)
    graphs = count_steps(tiny_model, 16, 0, 2, graphs=True)
    assert all(c.num_syncs == 1 for c in graphs)
    assert max(c.num_ops for c in graphs) * 5 < min(c.num_ops for c in eager)


def test_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--concurrency", "2", "--spec-tokens", "0", "--steps", "2", "--runs", "1", "--graphs", "both",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    eager, graphs = report["points"]
    assert (eager["decode_graphs"], graphs["decode_graphs"]) == (False, True)
    assert eager["syncs_per_step_max"] == graphs["syncs_per_step_max"] == 1
    assert eager["host_ms_per_step"] > 0 and graphs["host_ms_per_step"] is None
    assert graphs["ops_per_step"] < eager["ops_per_step"]
    with pytest.raises(SystemExit):
        main(["--concurrency", "0"])
