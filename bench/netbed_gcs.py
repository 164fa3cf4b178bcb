"""The bed's head with GCS fault tolerance (`BedSpec(redis_port=...)`): a real `redis-server` in
host 0's namespace (its loopback, a password), the head's GCS storing its tables there, and a way
to kill the GCS and start it again as KubeRay restarts a head pod's GCS.

    redis-server 127.0.0.1:<redis_port> in hsbed<s>-h0   --save "" --appendonly no (Redis holds the
                                                         tables in memory; it outlives the GCS, not a host)
    ray start --head  + RAY_REDIS_ADDRESS=127.0.0.1:<port>, --redis-password, RAY_external_storage_namespace
    gcs = kill_gcs(bed)       SIGKILL the head's gcs_server; its argv, environment and cwd kept
    restart_gcs(bed, gcs)     exec the same argv with the same environment in host 0's namespace:
                              the GCS reloads nodes, actors, placement groups and KV from Redis;
                              raylets and core workers reconnect (they wait for it up to
                              RAY_gcs_rpc_server_reconnect_timeout_s, 60 s by default, then exit)

Without Redis a restarted GCS starts empty: every raylet then finds its node unknown and exits.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench import netbed_net as net
from bench.netbed_net import BedError

REDIS_MISSING = "`redis-server` not found: install it (Debian: apt-get install redis-server; `make test` does)"


def redis_reason() -> str | None:
    """None where a redis-server can be started here, else why not."""
    return REDIS_MISSING if shutil.which("redis-server") is None else None


def redis_password(bed_dir: Path) -> str:
    return (bed_dir / "auth_token").read_text()[:32]  # the bed's own secret; Redis is reachable from host 0 only


def head_env(slot: int, redis_port: int) -> dict[str, str]:
    """What `ray start --head` needs in its environment to keep the GCS's tables in Redis."""
    return {"RAY_REDIS_ADDRESS": f"127.0.0.1:{redis_port}", "RAY_external_storage_namespace": f"hsbed{slot}"}


def start_redis(bed, timeout_s: float = 20.0) -> subprocess.Popen:
    """redis-server on host 0's loopback, waited for until it answers PING."""
    if reason := redis_reason():
        raise BedError(reason)
    port, password = str(bed.spec.redis_port), redis_password(bed.dir)
    with open(bed.dir / "redis.log", "w") as log:
        proc = bed.popen_in(0, ["redis-server", "--bind", "127.0.0.1", "--port", port, "--requirepass", password,
                                "--save", "", "--appendonly", "no", "--dir", str(bed.dir)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        r = bed.run_in(0, ["redis-cli", "-p", port, "-a", password, "--no-auth-warning", "ping"], check=False)
        if r.stdout.strip() == "PONG":
            return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            raise BedError(f"redis-server on host 0 did not answer PING: {r.stdout}{r.stderr}\n"
                           f"{(bed.dir / 'redis.log').read_text()[-2000:]}")
        time.sleep(0.1)


@dataclass(frozen=True)
class GcsProcess:
    """A killed gcs_server: what starts it again."""

    pid: int
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def gcs_pid(bed) -> int:
    """The live gcs_server in host 0's namespace."""
    for pid in net.netns_pids(bed.hosts[0].netns):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "gcs_server" and _alive(pid):
                return pid
        except OSError:
            pass
    raise BedError(f"no gcs_server running in {bed.hosts[0].netns}")


def kill_gcs(bed, timeout_s: float = 10.0) -> GcsProcess:
    """SIGKILL the head's gcs_server (no clean shutdown: as a crashed pod); returns how to restart it."""
    pid = gcs_pid(bed)
    proc = Path(f"/proc/{pid}")
    argv = tuple(a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a)
    env = dict(kv.decode().split("=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
    gcs = GcsProcess(pid, argv, env, os.readlink(proc / "cwd"))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            raise BedError(f"gcs_server {pid} still alive {timeout_s:.0f} s after SIGKILL")
        time.sleep(0.02)
    return gcs


def restart_gcs(bed, gcs: GcsProcess) -> subprocess.Popen:
    """The killed GCS started again, the same argv, environment and cwd, in host 0's namespace."""
    with open(bed.dir / "h0" / "gcs_restart.log", "a") as log:
        return subprocess.Popen(["ip", "netns", "exec", bed.hosts[0].netns, *gcs.argv], env=gcs.env, cwd=gcs.cwd,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
