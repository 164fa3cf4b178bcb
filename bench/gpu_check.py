"""`make gpu-check` / `python -m bench.gpu_check`: a borrowed CUDA machine turned into evidence in 10 minutes.

Four steps, each a subprocess under its own time limit (a hang or a crash costs that step, not the run):

  install    pip install the [cuda] extra (mamba-ssm, causal-conv1d, flash-attn) into this Python, compiled
             for this GPU's architecture only; nothing to do when all three import already
  gpu-tests  pytest -m gpu: the CUDA kernels against the torch reference paths (flash-attn in bf16) and the
             model on CUDA against the CPU
  transfer   a cached 4096-token prefix streamed between two GPUs over NCCL by the replicas' own path
             (workers.transfer) vs a raw NCCL send of the same bytes. NCCL takes one rank per GPU, so on
             one GPU this step is skipped and says why
  engine     output tokens/s at concurrency 1 and 32 on CUDA: bench.engine's prompts through
             bench.concurrency (`python -m bench.engine --concurrency 1,32` runs on the CPU)

Prints one table and writes the JSON report (--out). Exits 1 when a step failed or ran out of time. Without
an NVIDIA GPU it says so and exits 0 before importing torch or running anything; a GPU that torch cannot use
(a CPU build of torch) exits 2. The module imports only the standard library, so `make gpu-check` asks the
system Python (`--find-gpu`) before it installs anything.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

TRAINED = "configs/models/tiny-trained"
STEPS = ("install", "gpu-tests", "transfer", "engine")
LIMITS_S = {"install": 210, "gpu-tests": 150, "transfer": 90, "engine": 120}  # 570 s of the 600
NO_GPU = "gpu-check: no NVIDIA GPU on this machine ({why}): nothing was run. Run `make gpu-check` where there is one."


@dataclass
class StepResult:
    name: str
    status: str  # ok | failed | timeout | skipped
    seconds: float
    limit_s: float
    summary: str
    detail: dict = field(default_factory=dict)


def find_gpus() -> tuple[list[str], str]:
    """(the GPUs, how they were found) or ([], why none): `nvidia-smi -L`, else the driver's device nodes."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        gpus = [line.strip() for line in out.splitlines() if line.startswith("GPU ")]
        if gpus:
            return gpus, "nvidia-smi -L"
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if nodes:
        return nodes, "/dev/nvidia*"
    return [], ("nvidia-smi lists none" if smi else "no nvidia-smi") + ", no /dev/nvidia* device"


def cuda_machine(gpus: list[str]) -> tuple[dict | None, str]:
    """What torch sees, or (None, why it cannot use the GPUs)."""
    try:
        import torch
    except ImportError:
        return None, f"gpu-check: {len(gpus)} GPU(s) found but {sys.executable} has no torch: run `make install`"
    if not torch.cuda.is_available():
        return None, (f"gpu-check: {len(gpus)} GPU(s) found but torch {torch.__version__} cannot use them "
                      f"(torch.version.cuda={torch.version.cuda}): install a CUDA build of torch")
    major, minor = torch.cuda.get_device_capability(0)
    return {"gpus": gpus, "device": torch.cuda.get_device_name(0), "device_count": torch.cuda.device_count(),
            "capability": f"{major}.{minor}", "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "python": sys.version.split()[0]}, ""


def run_command(cmd: list[str], limit_s: float, env: dict | None = None) -> tuple[int | None, str, float]:
    """Run `cmd` in a process group of its own, killed whole at `limit_s`.
    Returns (exit code, None on timeout; the last 4000 characters of its output; seconds)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is alive, so its group id is still its own
            proc.wait()
            rc = None
        log.seek(max(0, log.seek(0, os.SEEK_END) - 4000))
        tail = log.read().decode(errors="replace")
    return rc, tail, round(time.monotonic() - t0, 1)


def last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")[:200]


def read_junit(path: Path) -> list[dict]:
    """One entry per test case of a pytest --junitxml report: test id, outcome, seconds, message."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                message = (child.get("message") or "")[:300]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    return cases


def run_pytest(name: str, pytest_args: list[str], limit_s: float, junit: Path) -> StepResult:
    """pytest under `limit_s`; ok only when at least one test passed and none failed."""
    rc, tail, seconds = run_command([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                                     f"--junitxml={junit}", *pytest_args], limit_s)
    if rc is None:
        return StepResult(name, "timeout", seconds, limit_s, f"killed after {limit_s:.0f} s: {last_line(tail)}")
    cases = read_junit(junit) if junit.is_file() else []
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    detail = {"counts": counts, "tests": cases}
    if counts["failed"] or rc not in (0, 5) or not cases:
        failed = [c for c in cases if c["outcome"] == "failed"]
        why = f"{failed[0]['test']}: {failed[0]['message']}" if failed else f"pytest exit {rc}: {last_line(tail)}"
        return StepResult(name, "failed", seconds, limit_s, f"{summary}; {why}", detail)
    if not counts["passed"]:
        reason = next(c["message"] for c in cases if c["outcome"] == "skipped")
        return StepResult(name, "failed", seconds, limit_s, f"no test ran: {reason}", detail)
    return StepResult(name, "ok", seconds, limit_s, summary, detail)


def gpu_test_files(root: Path = Path("tests")) -> list[str]:
    """The test files that mark tests `gpu` (collecting only these keeps the step's seconds for the tests)."""
    return sorted(str(p) for p in root.rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def step_install(limit_s: float, machine: dict, work: Path) -> StepResult:
    import importlib

    from workers.model.kernels import missing_cuda_packages

    if not missing_cuda_packages():
        return StepResult("install", "ok", 0.0, limit_s, "the [cuda] kernels import already")
    import torch

    pin = work / "torch-pin.txt"  # the kernels' own requirements must not swap torch for PyPI's
    pin.write_text(f"torch=={torch.__version__}\n")
    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 4), TORCH_CUDA_ARCH_LIST=machine["capability"])
    pip = [sys.executable, "-m", "pip", "install", "-c", str(pin)]
    t0, rc, tail = time.monotonic(), 0, ""
    for cmd in (pip + ["ninja", "packaging", "wheel", "setuptools"],
                pip + ["--no-build-isolation", "-e", ".[cuda]"]):
        left = limit_s - (time.monotonic() - t0)
        rc, tail, _ = run_command(cmd, left, env) if left > 1 else (None, "", 0.0)
        if rc != 0:
            break
    seconds = round(time.monotonic() - t0, 1)
    importlib.invalidate_caches()
    missing = missing_cuda_packages()
    if rc is None:
        return StepResult("install", "timeout", seconds, limit_s,
                          f"killed after {limit_s:.0f} s compiling; build the kernels once beforehand "
                          "(pip install --no-build-isolation -e '.[cuda]') or use the cuda image")
    if rc or missing:
        return StepResult("install", "failed", seconds, limit_s, f"pip exit {rc}, missing {missing}: {last_line(tail)}")
    return StepResult("install", "ok", seconds, limit_s, "installed mamba_ssm, causal_conv1d, flash_attn")


def step_measurement(name: str, limit_s: float, work: Path, summarize) -> StepResult:
    """`python -m bench.gpu_check --step NAME` in a subprocess; its JSON result, summarized."""
    result_path = work / f"{name}.json"
    rc, tail, seconds = run_command([sys.executable, "-m", "bench.gpu_check", "--step", name,
                                     "--result", str(result_path)], limit_s)
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if rc is None:
        return StepResult(name, "timeout", seconds, limit_s, f"killed after {limit_s:.0f} s: {last_line(tail)}", result)
    if rc or "error" in result:
        why = result.get("error") or f"exit {rc}: {last_line(tail)}"
        return StepResult(name, "failed", seconds, limit_s, f"{summarize(result)}; {why}".lstrip("; "), result)
    return StepResult(name, "ok", seconds, limit_s, summarize(result), result)


def summarize_engine(r: dict) -> str:
    levels = r.get("levels") or []
    if not levels:
        return ""
    rates = ", ".join(f"C={lv['concurrency']} {lv['output_tokens_per_s']} tok/s" for lv in levels)
    ratio = levels[-1].get(f"ratio_vs_{levels[0]['concurrency']}")
    return (f"{rates} ({ratio}x); outputs equal across levels: {r.get('outputs_equal_across_levels')}; "
            f"kernels {r.get('kernels')}")


def summarize_transfer(r: dict) -> str:
    parts = [f"{r['payload_mb']} MB: raw {r['raw_mb_s']} MB/s"] if "raw_mb_s" in r else []
    if "transfer_mb_s" in r:
        parts.append(f"transfer {r['transfer_mb_s']} MB/s ({r['transfer_over_raw']} of raw)")
    return ", ".join(parts)


SUMMARIES = {"engine": summarize_engine, "transfer": summarize_transfer}


def run_steps(names: list[str], machine: dict, budget_s: float) -> list[StepResult]:
    deadline = time.monotonic() + budget_s
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        for name in names:
            limit = round(min(LIMITS_S[name], deadline - time.monotonic() - 5), 1)
            if limit < 10:
                results.append(StepResult(name, "skipped", 0.0, 0.0, f"no time left of the {budget_s:.0f} s budget"))
            elif name == "install":
                results.append(step_install(limit, machine, work))
            elif name == "gpu-tests":
                results.append(run_pytest(name, ["-m", "gpu", *gpu_test_files()], limit, work / "junit.xml"))
            elif name == "transfer" and machine["device_count"] < 2:
                results.append(StepResult(name, "skipped", 0.0, limit, "NCCL takes one rank per GPU: needs 2 GPUs, "
                                          f"{machine['device_count']} visible"))
            else:
                results.append(step_measurement(name, limit, work, SUMMARIES[name]))
            print(f"gpu-check: {name}: {results[-1].status} ({results[-1].seconds:.0f} s)", flush=True)
    return results


def render_table(machine: dict, results: list[StepResult]) -> str:
    head = (f"gpu-check on {machine['device']} x{machine['device_count']} (torch {machine['torch']}, "
            f"CUDA {machine['torch_cuda']}, sm {machine['capability']}): "
            f"{sum(r.seconds for r in results):.0f} s")
    rows = [("step", "status", "time", "limit", "result")]
    rows += [(r.name, r.status, f"{r.seconds:.0f}s", f"{r.limit_s:.0f}s", r.summary) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    return "\n".join([head, *lines])


def exit_code(results: list[StepResult]) -> int:
    return 1 if any(r.status in ("failed", "timeout") for r in results) else 0


def run_measurement_step(name: str, result_path: Path) -> int:
    """The child side of `step_measurement`: measure, write JSON (the error too), exit 0 / 1."""
    from bench.gpu_check_measure import measure_engine, measure_transfer

    try:
        result = measure_engine() if name == "engine" else measure_transfer()
    except Exception as exc:  # the step reports it; the parent's table carries on
        result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    result_path.write_text(json.dumps(result, indent=2))
    return 1 if "error" in result else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/gpu_check.json", help="the JSON report (default out/gpu_check.json)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--budget-s", type=float, default=600.0, help="all steps together (default 600)")
    p.add_argument("--find-gpu", action="store_true",
                   help="only say whether there is an NVIDIA GPU (exit 0) or not (exit 1)")
    p.add_argument("--step", choices=("transfer", "engine"), help=argparse.SUPPRESS)  # the measuring child
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step:
        return run_measurement_step(args.step, args.result)
    names = [s for s in args.steps.split(",") if s]
    if unknown := sorted(set(names) - set(STEPS)):
        p.error(f"unknown steps {unknown}; choose from {','.join(STEPS)}")
    gpus, how = find_gpus()
    if not gpus:
        print(NO_GPU.format(why=how))
        return 1 if args.find_gpu else 0
    if args.find_gpu:
        print(f"gpu-check: {len(gpus)} GPU(s) ({how})")
        return 0
    machine, why = cuda_machine(gpus)
    if machine is None:
        print(why, file=sys.stderr)
        return 2
    results = run_steps(names, machine, args.budget_s)
    print(render_table(machine, results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "budget_s": args.budget_s, "ok": exit_code(results) == 0,
                               "steps": [asdict(r) for r in results]}, indent=2))
    print(f"gpu-check: report in {out}")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
