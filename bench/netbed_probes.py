"""Probes across the multi-host bed's links (`bench.netbed`): a timed TCP stream and a connect test,
each end a plain Python socket process run inside a host's namespace.

    python -m bench.netbed_probes sink ADDR            listen on ADDR (port printed), count bytes to EOF
    python -m bench.netbed_probes source ADDR PORT S   stream zeros to ADDR:PORT for S seconds
    python -m bench.netbed_probes connect ADDR PORT T  try one TCP connect within T seconds

The rate is measured where the bytes arrive (first byte to EOF), so a shaped link's queue drains
inside the measurement.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

CHUNK = 64 * 1024


def sink(addr: str) -> None:
    with socket.create_server((addr, 0)) as srv:
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        conn, _ = srv.accept()
        with conn:
            num_bytes, first = 0, None
            while data := conn.recv(CHUNK):
                first = first or time.perf_counter()
                num_bytes += len(data)
            seconds = time.perf_counter() - first if first else 0.0
    print(json.dumps({"bytes": num_bytes, "seconds": seconds}), flush=True)


def source(addr: str, port: int, seconds: float) -> None:
    buf, sent = bytes(CHUNK), 0
    with socket.create_connection((addr, port), timeout=30) as s:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            s.sendall(buf)
            sent += CHUNK
    print(json.dumps({"bytes": sent}), flush=True)


@dataclass(frozen=True)
class ConnectResult:
    ok: bool
    error: str  # "" when ok
    seconds: float  # the connect alone (one round trip when ok)


def connect(addr: str, port: int, timeout_s: float) -> None:
    t0, error = time.perf_counter(), ""
    try:
        socket.create_connection((addr, port), timeout=timeout_s).close()
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps(asdict(ConnectResult(not error, error, time.perf_counter() - t0))))


def measure_tcp_rate(bed, src: int, dst: int, seconds: float = 2.0) -> float:
    """Bytes/s of one TCP stream from host `src` to host `dst`, as `dst` received it."""
    me = [sys.executable, "-m", "bench.netbed_probes"]
    rx = bed.popen_in(dst, [*me, "sink", bed.hosts[dst].address], stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(rx.stdout.readline())["port"]
        bed.run_in(src, [*me, "source", bed.hosts[dst].address, str(port), str(seconds)], timeout=seconds + 60)
        got = json.loads(rx.stdout.readline())
        rx.wait(timeout=30)
    finally:
        rx.kill()
        rx.wait()
    return got["bytes"] / got["seconds"]


def try_connect(bed, src: int, dst: int, port: int, timeout_s: float = 1.0) -> ConnectResult:
    """One TCP connect from host `src` to host `dst`'s `port`, given up after `timeout_s`."""
    r = bed.run_in(src, [sys.executable, "-m", "bench.netbed_probes", "connect", bed.hosts[dst].address,
                         str(port), str(timeout_s)], timeout=timeout_s + 30)
    return ConnectResult(**json.loads(r.stdout))


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "sink":
        sink(rest[0])
    elif cmd == "source":
        source(rest[0], int(rest[1]), float(rest[2]))
    elif cmd == "connect":
        connect(rest[0], int(rest[1]), float(rest[2]))
    else:
        sys.exit(f"unknown probe {cmd!r}: sink, source or connect")
