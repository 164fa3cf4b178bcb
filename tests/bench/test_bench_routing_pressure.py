"""`python -m bench.routing_pressure` end to end on a trace prefix, and its check on rows made to
hold and to fail."""

import json

import pytest

from bench.routing_pressure import checks, main, markdown


def row(policy, hit_tokens, share=0.25, replicas=16, trace="t", num_input_tokens=1000):
    return {"trace": trace, "replicas": replicas, "share": share, "policy": policy,
            "num_hit_tokens": hit_tokens, "hit_rate": hit_tokens / num_input_tokens}


def test_table_runs_every_policy_per_cell_and_reports_the_check(capsys, tmp_path):
    md, out = tmp_path / "table.md", tmp_path / "report.json"
    assert main(["--traces", "shipped,agent", "--limit", "200", "--jobs", "1", "--replicas", "2",
                 "--shares", "0.25,1.0", "--markdown", str(md), "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report
    runs = {(r["trace"], r["replicas"], r["share"], r["policy"]) for r in report["rows"]}
    assert runs == {(t, 2, s, p) for t in ("shipped", "agent") for s in (0.25, 1.0)
                    for p in ("hybrid", "oracle", "round_robin")}
    assert all(r["num_requests"] == 200 for r in report["rows"])
    assert all(0 <= r["num_hit_tokens"] <= r["num_input_tokens"] for r in report["rows"])
    assert len(report["checks"]) == 4
    for c in report["checks"]:
        assert c["holds"] == (c["hybrid_hit_tokens"] >= 0.95 * c["oracle_hit_tokens"])
    text = md.read_text()
    assert text.count("\n| shipped | 2 |") == 2 and text.count("\n| agent | 2 |") == 2
    assert f"checks: {sum(c['holds'] for c in report['checks'])} of 4 hold" in text


def test_the_oracle_pools_the_memory_of_every_replica(capsys):
    """Both runs get the same per-replica budget; the oracle's one cache holds R x that, so at R = 1
    it is the single replica's cache and routing has nothing to lose."""
    assert main(["--traces", "chat", "--limit", "200", "--jobs", "1", "--replicas", "1",
                 "--shares", "0.5", "--baseline", "none"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"hybrid", "oracle"}
    assert rows["hybrid"]["budget_bytes_per_replica"] == rows["oracle"]["budget_bytes_per_replica"]
    assert rows["hybrid"]["num_hit_tokens"] == rows["oracle"]["num_hit_tokens"]


def test_checks_hold_and_fail_at_the_target():
    rows = [row("hybrid", 950), row("oracle", 1000), row("round_robin", 100),
            row("hybrid", 949, share=0.5), row("oracle", 1000, share=0.5),
            row("hybrid", 0, share=1.0), row("oracle", 0, share=1.0),
            row("hybrid", 10, replicas=64)]  # no oracle: no check
    found = {(c["replicas"], c["share"]): c for c in checks(rows)}
    assert set(found) == {(16, 0.25), (16, 0.5), (16, 1.0)}
    assert found[(16, 0.25)]["holds"] and found[(16, 0.25)]["hybrid_over_oracle"] == 0.95
    assert not found[(16, 0.5)]["holds"]
    assert found[(16, 1.0)]["holds"] and found[(16, 1.0)]["hybrid_over_oracle"] is None
    table = markdown(rows, checks(rows))
    assert ("| trace | R | share | hybrid hit rate | oracle hit rate | round_robin hit rate | hybrid / oracle "
            "| round_robin / oracle | >= 0.95 |") in table
    assert "| t | 16 | 0.25 | 0.950 | 1.000 | 0.100 | 0.950 | 0.100 | yes |" in table
    assert "| t | 16 | 0.5 | 0.949 | 1.000 | - | 0.949 | - | **no** |" in table
    assert "| t | 64 | 0.25 | 0.010 | - | - | - | - | - |" in table
    assert "checks: 2 of 3 hold" in table
    assert "fails: hybrid / oracle on t R=16 share 0.5: 0.949 < 0.95 (949 vs 1000 hit tokens)" in table


def test_a_cell_whose_replicas_cannot_hold_a_state_page_is_reported_not_run():
    """Each replica's budget split below 2 pages of a group refuses to build: the oracle (the R
    budgets pooled) still runs, hybrid does not, and the check is neither held nor failed."""
    broken = dict(row("hybrid", 0, replicas=64), num_hit_tokens=None, hit_rate=None, error="gives (150, 0) blocks")
    rows = [broken, row("oracle", 700, replicas=64), row("hybrid", 960), row("oracle", 1000)]
    found = checks(rows)
    assert [(c["replicas"], c["holds"]) for c in found] == [(64, None), (16, True)]
    assert found[0]["not_run"] == "gives (150, 0) blocks"
    table = markdown(rows, found)
    assert "| t | 64 | 0.25 | - | 0.700 | - | not run |" in table
    assert "checks: 1 of 2 hold, 1 not run" in table
    assert "- not run: t R=64 share 0.25: gives (150, 0) blocks" in table


@pytest.mark.parametrize("argv, message", [
    (["--traces", "nope"], "unknown trace 'nope'"),
    (["--replicas", "16,x"], "--replicas takes integers"),
    (["--replicas", "0"], "--replicas must all be >= 1"),
    (["--shares", "0.1,0"], "--shares must all be positive"),
    (["--baseline", "oracle"], "--baseline must be one of"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_bad_arguments_are_refused_with_a_message(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_host_tier_reaches_every_replica_and_the_oracle_pools_it(capsys):
    """`--host-share`: every run gets a host tier (the oracle R x the per-replica one) and serves
    hits from it; without the flag no run has one. At R = 1 the oracle is the replica, host tier
    and all, so they hit alike; the host tier adds hits the device budget alone lost."""
    argv = ["--traces", "chat", "--limit", "200", "--jobs", "1", "--replicas", "1", "--shares", "0.1",
            "--baseline", "none"]
    assert main([*argv, "--host-share", "1.0"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in report["rows"]}
    assert report["host_share"] == 1.0 and all(r["host_share"] == 1.0 for r in rows.values())
    assert rows["hybrid"]["host_bytes_per_replica"] == rows["oracle"]["host_bytes_per_replica"] > 0
    assert rows["hybrid"]["num_host_hit_tokens"] > 0
    assert rows["hybrid"]["num_hit_tokens"] == rows["oracle"]["num_hit_tokens"]
    assert main(argv) == 0
    without = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert all(r["host_bytes_per_replica"] == 0 and r["num_host_hit_tokens"] == 0 for r in without.values())
    assert rows["hybrid"]["num_hit_tokens"] > without["hybrid"]["num_hit_tokens"]


@pytest.mark.parametrize("flag", ["0", "-0.5"])
def test_a_host_share_that_is_not_positive_is_refused(flag, capsys):
    assert main(["--host-share", flag, "--limit", "10"]) == 2
    assert "--host-share must be positive" in capsys.readouterr().err
