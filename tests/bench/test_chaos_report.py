"""The chaos soak's bookkeeping (`bench.chaos_report`, `bench.chaos`'s schedule and arguments),
without a bed: the soak itself runs under `make chaos` (tests/cluster/test_chaos.py)."""

from __future__ import annotations

import pytest

from bench import chaos
from bench.chaos_report import FaultWindow, availability, by_fault, format_table, score


def _rec(t0: float, t1: float, status: str = "ok", attempts: int = 1) -> dict:
    return {"t0": t0, "t1": t1, "status": status, "attempts": attempts}


def test_each_request_is_scored_in_the_window_it_started_in():
    windows = [FaultWindow("kill_replica", 10.0, recovery_s=2.0), FaultWindow("slow_link", 20.0, recovery_s=1.0)]
    records = [_rec(5, 6), _rec(10, 31), _rec(12, 13, attempts=3), _rec(19.9, 20.5, "differ"),
               _rec(20, 21, "lost", attempts=8), _rec(25, 26, "error")]
    totals = score(windows, records, t_end=30.0)
    assert totals == {"sent": 6, "completed": 3, "retried": 1, "lost": 2, "differing": 1}
    first, second = windows
    assert (first.until, second.until) == (20.0, 30.0)  # to the next injection, the last to the end
    assert (first.sent, first.completed, first.retried, first.differing, first.lost) == (3, 2, 1, 1, 0)
    assert (second.sent, second.completed, second.lost) == (2, 0, 2)  # "error" (not retryable) is lost
    assert not first.ok and not second.ok  # a difference, a loss
    assert FaultWindow("x", 0.0, recovery_s=0.5).ok and not FaultWindow("x", 0.0, recovery_s=None).ok


def test_a_window_ended_by_its_phase_keeps_its_end():
    """The last fault of the TP=1 phase ends with that phase's traffic, not at the TP=2 phase's
    first fault (requests in between, none, must not be charged to it)."""
    windows = [FaultWindow("node_loss", 10.0, until=15.0, recovery_s=1.0), FaultWindow("kill_tp_rank", 40.0)]
    score(windows, [_rec(16, 17, "lost")], t_end=50.0)
    assert windows[0].until == 15.0 and windows[0].sent == 0 and windows[1].until == 50.0


def test_by_fault_sums_occurrences_and_keeps_the_worst_recovery():
    windows = [FaultWindow("a", 0, recovery_s=1.0, sent=3, completed=3), FaultWindow("b", 5, recovery_s=None, sent=1),
               FaultWindow("a", 9, recovery_s=4.5, sent=2, completed=1, lost=1)]
    rows = by_fault(windows)
    assert rows["a"]["times"] == 2 and rows["a"]["sent"] == 5 and rows["a"]["lost"] == 1
    assert rows["a"]["max_recovery_s"] == 4.5
    assert rows["b"]["max_recovery_s"] is None  # one never recovered: no worst time to give
    table = format_table(windows, t_start=0.0)
    assert table.count("\n") == 4 and "never" in table


def test_availability_counts_each_request_once_in_the_second_it_finished():
    windows = [FaultWindow("kill_controller", 102.0, until=104.0)]
    records = [_rec(100.0, 100.5), _rec(101, 102.2, attempts=2), _rec(101, 103.9, "lost"), _rec(99, 200.0)]
    rows = availability(records, windows, t_start=100.0, t_end=105.0)
    assert [r["t_s"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert sum(r["finished"] for r in rows) == len(records)  # the late one lands in the last second
    assert rows[2]["completed"] == 1 and rows[2]["retried"] == 1 and rows[3]["lost"] == 1
    assert rows[5]["finished"] == 1
    assert [r["fault"] for r in rows] == ["", "", "kill_controller", "kill_controller", "kill_controller", ""]


def test_schedule_is_seeded_and_each_round_holds_every_fault():
    faults = list(chaos.FAULTS)
    assert chaos.schedule(faults, seed=3, round_index=0) == chaos.schedule(faults, seed=3, round_index=0)
    assert chaos.schedule(faults, 3, 0) != chaos.schedule(faults, 3, 1)  # rounds differ in order
    assert sorted(chaos.schedule(faults, 3, 1)) == sorted(faults)


def test_every_fault_the_issue_names_is_in_the_soak():
    assert set(chaos.FAULTS) == {"kill_replica", "kill_tp_rank", "kill_cache_service", "kill_controller",
                                 "kill_frontdoor", "drop_events", "reorder_events", "corrupt_transfer",
                                 "slow_link", "node_loss", "gcs_restart"}


def test_counter_deltas_keep_what_moved():
    before = {"retries": 2, "replica_deaths": 0, "other": 5}
    after = {"retries": 5, "replica_deaths": 0, "service_resyncs": 1, "other": 9}
    assert chaos._deltas(before, after) == {"retries": 3, "service_resyncs": 1}


@pytest.mark.parametrize("argv", [["--faults", "kill_replica,unplug_rack"], ["--faults", ","], ["--minutes", "0"],
                                  ["--concurrency", "0"]])
def test_bad_arguments_are_refused_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        chaos.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unplug_rack" in err or "must be" in err or "(none given)" in err
