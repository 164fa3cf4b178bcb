"""`make gpu-check` / bench/gpu_check.py on this CPU machine: the no-GPU path end to end (it must say so, exit 0
and run nothing), and the parts of the GPU path that need no GPU: the time limit that kills a step's whole
process group, the pytest step's verdicts, the table and the exit code."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check import StepResult

REPO = Path(__file__).resolve().parents[2]
needs_no_gpu = pytest.mark.skipif(bool(gpu_check.find_gpus()[0]),
                                  reason="this machine has an NVIDIA GPU: gpu-check would run for real")


@needs_no_gpu
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    out = tmp_path / "report.json"
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "bench.gpu_check", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("gpu-check: no NVIDIA GPU on this machine (") and "nothing was run" in run.stdout
    assert not out.exists() and time.monotonic() - t0 < 10
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if "|" in line}
    assert {"json", "bench"} <= imported  # the report shows its imports
    assert not {m for m in imported if m.split(".")[0] in ("torch", "pytest", "workers", "cluster")}
    assert "bench.gpu_check_measure" not in imported
    find = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--find-gpu"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert find.returncode == 1 and "no NVIDIA GPU" in find.stdout  # what the make target's `if` tests


@needs_no_gpu
def test_make_gpu_check_without_a_gpu_exits_0_before_installing_anything(tmp_path):
    venv, out = tmp_path / "venv", tmp_path / "report.json"
    run = subprocess.run(["make", "--no-print-directory", "gpu-check", f"VENV={venv}", f"GPU_CHECK_OUT={out}"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "gpu-check: no NVIDIA GPU on this machine" in run.stdout
    assert not venv.exists() and not out.exists()  # `make install` never ran, nor the check


def test_a_gpu_that_torch_cannot_use_is_an_error(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch can use a GPU here")
    monkeypatch.setattr(gpu_check, "find_gpus", lambda: (["GPU 0: NVIDIA H200 (UUID: GPU-0)"], "nvidia-smi -L"))
    monkeypatch.setattr(gpu_check, "run_steps", lambda *a: pytest.fail("a step ran"))
    assert gpu_check.main(["--out", str(tmp_path / "r.json")]) == 2
    assert "1 GPU(s) found but torch" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_step_past_its_limit_is_killed_with_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "pid"
    t0 = time.monotonic()
    rc, tail, seconds = gpu_check.run_command(
        ["sh", "-c", f"echo started; sleep 60 & echo $! > {pid_file}; wait"], 0.5)
    assert rc is None and tail.strip() == "started" and 0.5 <= seconds < 3 and time.monotonic() - t0 < 3
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 2
    while alive(child) and time.monotonic() < deadline:  # SIGKILL lands asynchronously
        time.sleep(0.02)
    assert not alive(child)  # the step's background child went with it
    assert gpu_check.run_command(["sh", "-c", "echo fine; exit 3"], 10)[:2] == (3, "fine\n")


def write_tests(path: Path, body: str) -> Path:
    path.write_text("import pytest\n\n" + body)
    return path


def test_the_pytest_step_passes_only_when_a_gpu_test_passed_and_none_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # these files need none of the suite's plugins
    ok = write_tests(tmp_path / "test_ok.py", (
        "@pytest.mark.gpu\ndef test_parity():\n    assert True\n\n"
        "@pytest.mark.gpu\ndef test_needs_kernels():\n    pytest.skip('kernels missing')\n\n"
        "def test_cpu_only():\n    assert False  # not gpu-marked: deselected\n"))
    result = gpu_check.run_pytest("gpu-tests", ["-m", "gpu", str(ok)], 60, tmp_path / "ok.xml")
    assert (result.status, result.summary) == ("ok", "1 passed, 0 failed, 1 skipped")
    assert [t["outcome"] for t in result.detail["tests"]] == ["passed", "skipped"]
    bad = write_tests(tmp_path / "test_bad.py", "@pytest.mark.gpu\ndef test_parity():\n    assert 1 == 2\n")
    result = gpu_check.run_pytest("gpu-tests", ["-m", "gpu", str(bad)], 60, tmp_path / "bad.xml")
    assert result.status == "failed" and result.summary.startswith("0 passed, 1 failed, 0 skipped; ")
    assert "test_parity" in result.summary
    broken = write_tests(tmp_path / "test_broken.py", (
        "@pytest.fixture\ndef kernels():\n    raise ImportError('mamba_ssm')\n\n"
        "@pytest.mark.gpu\ndef test_parity(kernels):\n    pass\n\n@pytest.mark.gpu\ndef test_other():\n    pass\n"))
    result = gpu_check.run_pytest("gpu-tests", ["-m", "gpu", str(broken)], 60, tmp_path / "broken.xml")
    assert result.status == "failed" and result.detail["counts"] == {"passed": 1, "failed": 1, "skipped": 0}
    skipped = write_tests(tmp_path / "test_skip.py",
                          "@pytest.mark.gpu\ndef test_parity():\n    pytest.skip('no cuda')\n")
    result = gpu_check.run_pytest("gpu-tests", ["-m", "gpu", str(skipped)], 60, tmp_path / "skip.xml")
    assert (result.status, result.summary) == ("failed", "no test ran: no cuda")


def test_the_gpu_tests_step_collects_the_kernel_parity_tests():
    files = gpu_check.gpu_test_files(REPO / "tests")
    assert str(REPO / "tests/model/test_kernels.py") in files
    assert all("pytest.mark.gpu" in Path(f).read_text() for f in files)


def test_one_table_and_an_exit_code_that_fails_on_failures_and_timeouts():
    machine = {"device": "NVIDIA H200", "device_count": 1, "torch": "2.13.0+cu128", "torch_cuda": "12.8",
               "capability": "9.0"}
    results = [StepResult("install", "ok", 0.0, 210, "the [cuda] kernels import already"),
               StepResult("transfer", "skipped", 0.0, 90, "NCCL takes one rank per GPU: needs 2 GPUs, 1 visible"),
               StepResult("engine", "ok", 41.4, 120, "C=1 300.0 tok/s, C=32 4000.0 tok/s (13.33x)")]
    lines = gpu_check.render_table(machine, results).splitlines()
    assert lines[0].startswith("gpu-check on NVIDIA H200 x1 (torch 2.13.0+cu128, CUDA 12.8, sm 9.0): 41 s")
    assert lines[1].split() == ["step", "status", "time", "limit", "result"]
    assert [line.split()[:4] for line in lines[2:]] == [["install", "ok", "0s", "210s"],
                                                        ["transfer", "skipped", "0s", "90s"],
                                                        ["engine", "ok", "41s", "120s"]]
    assert all(line.endswith(r.summary) for line, r in zip(lines[2:], results))
    assert gpu_check.exit_code(results) == 0
    for bad in ("failed", "timeout"):
        assert gpu_check.exit_code([*results, StepResult("gpu-tests", bad, 1.0, 150, "")]) == 1
