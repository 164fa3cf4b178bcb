"""`python -m bench.memory_pressure` end to end on a trace prefix, and its checks on rows made to
hold and to fail."""

import json

import pytest

import bench.memory_pressure as mp
from bench.memory_pressure import checks, main, markdown
from cache_service.trace_sim.cli import DEFAULT_TRACE
from cache_service.trace_sim.tuning import MARCONI_ALPHAS, PUBLISHED_ALPHAS


def row(trace, share, retention, eviction, hit_rate, replicas=1):
    return {"trace": trace, "replicas": replicas, "share": share, "retention": retention,
            "eviction": eviction, "hit_rate": hit_rate}


def test_table_runs_every_cell_on_both_traces_and_reports_the_checks(capsys, tmp_path):
    md = tmp_path / "table.md"
    assert main(["--limit", "60", "--jobs", "1", "--replicas", "1,2", "--shares", "0.25",
                 "--cells", "latest/lru,latest/marconi,latest/value,dense/value",
                 "--markdown", str(md)]) == 0
    report = json.loads(capsys.readouterr().out)
    cells = {(r["trace"], r["replicas"], r["cell"]) for r in report["rows"]}
    assert cells == {(t, n, c) for t in ("shipped", "chat") for n in (1, 2)
                     for c in ("latest/lru", "latest/marconi", "latest/marconi-published", "latest/value",
                               "dense/value")}
    assert all(0.0 <= r["hit_rate"] <= 1.0 for r in report["rows"])
    # marconi is its best alpha: a number was chosen, not the untuned default name
    assert all(":" in r["eviction"] for r in report["rows"] if r["eviction"].startswith("marconi"))
    # the published column names the alpha its bootstrap chose, from the published grid
    published = [r["eviction"] for r in report["rows"] if r["cell"] == "latest/marconi-published"]
    assert len(published) == 4 and all(float(e.split(":")[1]) in PUBLISHED_ALPHAS for e in published)
    for r in report["rows"]:  # with what its tuning saw (a window of 0: it never evicted)
        if r["cell"] == "latest/marconi-published":
            assert float(r["eviction"].split(":")[1]) == r["marconi_tuning"]["alpha"]
    # per (trace, R): value vs both Marconi columns, value vs 1.5 lru (share 0.25), dense vs latest
    assert len(report["checks"]) == 4 * 4
    text = md.read_text()
    assert text.count("\n| shipped |") == 2 and text.count("\n| chat |") == 2
    assert "| latest/lru | latest/marconi | latest/marconi-published | latest/value | dense/value |" in text
    assert f"checks: {sum(c['holds'] for c in report['checks'])} of 16 hold" in text


def test_a_value_setting_gets_its_own_column(capsys):
    """`--cells latest/value:1` runs `value:1` (tau one mean reuse distance) beside `value`, in
    its own column, not merged into value's."""
    assert main(["--limit", "60", "--jobs", "1", "--replicas", "1", "--shares", "0.25", "--traces", "chat",
                 "--cells", "latest/value,latest/value:1"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert sorted((r["cell"], r["eviction"]) for r in rows) == [("latest/value", "value"),
                                                               ("latest/value:1", "value:1")]


def test_checks_compare_the_right_cells_and_report_failures():
    rows = [row("t", 0.25, "latest", "lru", 0.10), row("t", 0.25, "latest", "marconi:2.0", 0.12),
            dict(row("t", 0.25, "latest", "marconi:0.5", 0.145), cell="latest/marconi-published"),
            row("t", 0.25, "latest", "value", 0.14), row("t", 0.25, "dense", "value", 0.13),
            row("t", 0.25, "value:3e8", "value", 0.15),
            row("t", 0.5, "latest", "lru", 0.2), row("t", 0.5, "latest", "value", 0.21)]
    found = {(c["share"], c["check"]): c for c in checks(rows)}
    assert set(found) == {(0.25, "value >= marconi"), (0.25, "value >= 1.5 x lru"),
                          (0.25, "dense/value >= latest/value"), (0.25, "value:3e8/value >= latest/value"),
                          (0.25, "value:3e8/value >= marconi"), (0.25, "value >= marconi-published"),
                          (0.25, "value:3e8/value >= marconi-published")}
    assert found[(0.25, "value >= marconi")]["holds"]
    assert not found[(0.25, "value >= marconi-published")]["holds"]  # 0.14 < 0.145: each column checked
    assert found[(0.25, "value >= marconi-published")]["right"] == 0.145
    assert found[(0.25, "value:3e8/value >= marconi-published")]["holds"]
    assert not found[(0.25, "value >= 1.5 x lru")]["holds"]  # 0.14 < 0.15
    assert found[(0.25, "value >= 1.5 x lru")]["right"] == 1.5 * 0.10
    assert not found[(0.25, "dense/value >= latest/value")]["holds"]
    assert found[(0.25, "value:3e8/value >= latest/value")]["holds"]
    assert found[(0.25, "value:3e8/value >= marconi")]["holds"]  # 0.15 >= 0.12
    table = markdown(rows, checks(rows))
    assert "checks: 4 of 7 hold" in table
    assert "fails: value >= 1.5 x lru on t R=1 share 0.25" in table
    assert "fails: value >= marconi-published on t R=1 share 0.25: 0.1400 vs 0.1450" in table
    assert "| t | 1 | 0.25 | 0.1000 | 0.1200 | 0.1450 | 0.1400 | 0.1300 | 0.1500 | 1.17 | 0.97 | 1.40 |" in table


def test_bad_arguments_are_refused_with_a_message(capsys):
    assert main(["--traces", "nope"]) == 2
    assert "unknown trace 'nope'" in capsys.readouterr().err
    assert main(["--cells", "latest"]) == 2
    assert "retention/eviction pairs" in capsys.readouterr().err
    assert main(["--seeds", "0"]) == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err


def test_seeds_rerun_the_routed_cells_and_the_table_takes_their_mean(monkeypatch, capsys):
    """`--seeds 3`: each R > 1 cell runs at simulate --seed 0, 1, 2 (R = 1 once: no routing
    choice); the table, its spread column and the checks use each cell's mean. `run_one` is
    replaced to isolate the bookkeeping: its hit rate is a function of the seed it is given."""
    seen = []

    def fake_run_one(args, policy, eviction, requests):
        seen.append((args.replicas, args.retention, eviction, args.seed))
        rate = {"lru": 0.1, "value": 0.2 + 0.01 * args.seed}[eviction]
        if args.retention == "dense":
            rate = 0.25 - 0.05 * args.seed  # above latest at seed 0, below it on the mean
        return {"eviction": eviction, "hit_rate": rate, "flops_saved_share": 0.0, "state_turnover": 0.0,
                "ttft_s": {"p50": 0.0, "p95": 0.0}}, []

    monkeypatch.setattr(mp, "run_one", fake_run_one)
    assert main(["--limit", "20", "--jobs", "1", "--traces", "shipped", "--replicas", "1,4", "--shares", "0.5",
                 "--cells", "latest/lru,latest/value,dense/value", "--seeds", "3"]) == 0
    cells = [("latest", "lru"), ("latest", "value"), ("dense", "value")]
    assert sorted(seen) == sorted([(1, r, e, 0) for r, e in cells] + [(4, r, e, s) for r, e in cells for s in range(3)])
    out = capsys.readouterr().out
    report = json.loads(out)
    assert sorted(r["seed"] for r in report["rows"] if r["replicas"] == 4) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    dense = {c["replicas"]: c for c in report["checks"] if c["check"] == "dense/value >= latest/value"}
    assert dense[1]["holds"] and (dense[1]["left"], dense[1]["right"]) == (0.25, 0.2)  # R = 1: seed 0
    assert not dense[4]["holds"]  # the mean, 0.20 < 0.21, though seed 0 alone would hold
    assert (dense[4]["left"], dense[4]["right"]) == (pytest.approx(0.20), pytest.approx(0.21))
    table = markdown(report["rows"], report["checks"])
    assert ("| latest/lru | latest/value | dense/value | value / marconi | value / published | value / lru "
            "| spread |") in table
    assert "| shipped | 4 | 0.5 | 0.1000 | 0.2100 | 0.2000 | - | - | 2.10 | 0.1000 |" in table  # dense: 0.25 - 0.15
    assert "| shipped | 1 | 0.5 | 0.1000 | 0.2000 | 0.2500 | - | - | 2.00 | 0.0000 |" in table


def test_marconi_cell_keeps_the_best_alpha_of_every_run_and_the_published_one(monkeypatch):
    """Every alpha is run on the same requests and the highest hit rate is kept (ties: the first,
    the smallest alpha); Marconi as its code runs (`run_one` with plain `marconi`: its own bootstrap
    tuning, here ending at 0.5) is its own row. `run_one` is replaced to isolate the choice."""
    rates = {0.5: 0.3, 2.0: 0.4, 4.0: 0.4}
    seen = []

    def fake_run_one(args, policy, eviction, requests):
        seen.append((eviction, len(requests), args.replicas, args.memory_share))
        eviction = "marconi:0.5" if eviction == "marconi" else eviction  # what the prefix tuning chose
        alpha = float(eviction.split(":")[1])
        return {"eviction": eviction, "hit_rate": rates.get(alpha, 0.1), "flops_saved_share": 0.0,
                "state_turnover": 0.0, "ttft_s": {"p50": 0.0, "p95": 0.0}}, []

    monkeypatch.setattr(mp, "run_one", fake_run_one)
    got = mp.run_cell(("shipped", DEFAULT_TRACE, 30, 2, 0.25, "latest", "marconi", 0))
    assert [e for e, *_ in seen] == [f"marconi:{a}" for a in MARCONI_ALPHAS] + ["marconi"]
    assert {(n, r, s) for _, n, r, s in seen} == {(30, 2, 0.25)}  # one cell's requests and budget
    assert [(r["cell"], r["eviction"], r["hit_rate"]) for r in got] == [
        ("latest/marconi", "marconi:2.0", 0.4), ("latest/marconi-published", "marconi:0.5", 0.3)]


def test_a_cell_outside_the_known_columns_still_gets_a_column():
    rows = [row("t", 0.25, "latest", "value", 0.14), row("t", 0.25, "2048", "value", 0.15)]
    assert "| trace | R | share | latest/value | 2048/value |" in markdown(rows, checks(rows))
