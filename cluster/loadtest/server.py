"""`spawn_server`: `python -m cluster.serve` as a subprocess on a free loopback port, for one variant.

    with spawn_server("configs/local.yaml", ["router.policy=round_robin"]) as server:
        run_workload(server.url, WorkloadConfig("resend"))

Waits for GET /health == 200 (raising `ServerStartError` with the log's tail if the process exits
or the timeout passes); on exit sends SIGTERM, then SIGKILL to its process group after
`stop_timeout_s`. The server's output goes to `log_path` (a temp file by default).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerHandle:
    url: str
    port: int
    process: subprocess.Popen
    log_path: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, num_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def _wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"server exited with code {proc.returncode} before answering /health; "
                                   f"log {log_path}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise ServerStartError(f"server at {url} not healthy after {timeout_s:.0f}s; log {log_path}:\n{_tail(log_path)}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 20.0) -> int:
    """SIGTERM to the server, then SIGKILL to its whole process group (its own, so that is the
    server and whatever it started, e.g. Ray workers) if it is still running after `timeout_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
    return proc.returncode


@contextlib.contextmanager
def spawn_server(config_path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, port: int | None = None,
                 log_path: str | Path | None = None, startup_timeout_s: float = 180.0,
                 stop_timeout_s: float = 20.0) -> Iterator[ServerHandle]:
    """A server started from `config_path` with `--set` `overrides` (e.g. `"engine.eagle_mode=drop"`)."""
    port = port or free_port()
    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix=f"hybridserve-loadtest-{port}-", suffix=".log")[1])
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "cluster.serve", "--config", str(config_path), "--port", str(port)]
    for override in overrides:
        cmd += ["--set", override]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        # a process group of its own (killed whole below) but not a session: Linux's autogroup
        # scheduler gives each session an equal share of the CPUs, and on a loaded host a client
        # in another session than the server it measures stalled for up to 1.5 s at a time
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                process_group=0)
    try:
        _wait_healthy(url, proc, log_path, startup_timeout_s)
        yield ServerHandle(url, port, proc, log_path)
    finally:
        stop_server(proc, stop_timeout_s)
