"""The chaos soak's short form (issue 30, item 6): `python -m bench.chaos --minutes 2` over the
multi-host bed, every fault at least once (one round on TP=1 replicas, kill_tp_rank on a TP=2
cluster). Marked `chaos`: `make chaos` runs it (about 5 minutes on 2 cores), `make test` deselects it.

Asserted from the soak's own report, not its exit code alone: every fault was injected and the
cluster came back clean after each (every replica serving, the index equal to the replicas'
caches, both front doors answering); every request finished with its cold output (none lost,
none differing), and traffic ran through every fault (requests started in each window);
availability per second accounts for every request; the bed left nothing behind.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from bench.chaos import FAULTS
from bench.netbed_gcs import redis_reason
from tests.cluster.netbed_fixture import require_netbed

pytestmark = [pytest.mark.chaos, pytest.mark.heavy, pytest.mark.timeout(1200)]


def test_short_soak_loses_nothing_and_recovers_from_every_fault(tmp_path):
    require_netbed()
    if reason := redis_reason():
        pytest.skip(f"gcs_restart needs Redis: {reason}")
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "bench.chaos", "--minutes", "2", "--seed", "1", "--gap-s", "3",
                           "--out", str(out)], capture_output=True, text=True, timeout=1100)
    report = json.loads((out / "chaos.json").read_text()) if (out / "chaos.json").exists() else None
    assert report is not None, f"no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stdout[-4000:]
    check_report(out, report)


def check_report(out, report: dict) -> None:
    """What a passing soak's report holds (also run by hand on a `--minutes 10` run's folder)."""
    assert set(report["by_fault"]) == set(FAULTS)
    for name, row in report["by_fault"].items():
        assert row["times"] >= 1 and row["max_recovery_s"] is not None, (name, row)
        assert row["lost"] == 0 and row["differing"] == 0, (name, row)
    fired = [w["fired"] for w in report["windows"]]
    assert fired == sorted(fired), "a fault's time taken from an earlier one (one at a time, in order)"
    for w in report["windows"]:
        assert w["fired"] < w["until"], w
        assert w["sent"] >= 1, f"no request started while {w['name']} was in force: {w}"
        assert w["recovery_s"] is not None and w["recovery_s"] >= 0
    totals = report["totals"]
    assert totals["lost"] == 0 and totals["differing"] == 0
    assert totals["completed"] == totals["sent"] >= 50
    assert sum(w["sent"] for w in report["windows"]) <= totals["sent"]
    tp = {w["name"]: w["detail"]["tp_size"] for w in report["windows"]}
    assert tp["kill_tp_rank"] == 2 and tp["kill_replica"] == 1

    rows = pq.read_table(out / "availability.parquet").to_pylist()
    assert sum(r["finished"] for r in rows) == totals["sent"]
    assert sum(r["completed"] for r in rows) == totals["completed"]
    assert {r["fault"] for r in rows} >= set(FAULTS)
    assert (out / "availability.png").stat().st_size > 10_000
    assert report["bed_leftovers"] == []
