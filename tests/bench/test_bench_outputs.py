"""Running a benchmark from the checkout's root leaves `git status` as it was: reports go under
`out/` (git-ignored) or where `--out` says, and nothing is left in the temp dir. The report-writing
benchmarks run for real, small."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.reports import default_report, write_report

ROOT = Path(__file__).resolve().parents[2]


def _scratch() -> set[str]:
    """hybridserve's folders in the temp dir (a benchmark's own random checkpoint goes there)."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("hybridserve-*")}


def _status() -> str:
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored=no"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout


def test_default_reports_are_under_out_and_write_report_makes_the_folder(tmp_path):
    assert default_report("faults") == "out/bench-faults.json"
    path = write_report(tmp_path / "a" / "b.json", {"x": 1})
    assert json.loads(path.read_text()) == {"x": 1}


@pytest.mark.heavy
@pytest.mark.timeout(300)
@pytest.mark.parametrize("module, args, report", [
    # ~25-40 s, and tests/bench/test_control_plane.py runs the same benchmark: make long
    pytest.param("bench.control_plane", ["--replicas", "4", "--decisions", "30", "--resync-entries", "200",
                                         "--no-tiny"], "out/bench-control-plane.json", marks=pytest.mark.long),
    # ~25 s (a Ray cluster): make long; the host-tier one below (~5 s, a random checkpoint it builds
    # itself) keeps a run from the root in make test
    pytest.param("bench.faults", ["--scenarios", "drop_events", "--num-prompts", "1", "--prompt-len", "64"],
                 "out/bench-faults.json", marks=pytest.mark.long),
    ("bench.host_tier_ttft", ["--prompt-len", "130", "--repeats", "1"], "out/bench-host_tier_ttft.json"),
])
def test_benchmark_run_from_the_root_leaves_git_status_clean(module, args, report):
    before, scratch = _status(), _scratch()
    (ROOT / report).unlink(missing_ok=True)
    run = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"report: {report}" in run.stdout and json.loads((ROOT / report).read_text())
    assert _status() == before
    assert _scratch() == scratch  # a checkpoint it built for itself is removed too
