"""A multi-host test bed on one machine: N hosts as Linux network namespaces on one bridge
(`bench.netbed_net`), `ray start --head` in the first and `ray start --address` in the others.

    python -m bench.netbed up [--hosts 3] [--no-ray]   build a bed, print it, hold it until Ctrl-C / SIGTERM
    python -m bench.netbed status                      the slots: owner, hosts, leftovers
    python -m bench.netbed down                        remove every bed whose owner is gone (crash cleanup)

    with NetBed(BedSpec(num_hosts=3)) as bed:          the Python API (tests: tests/cluster/netbed_fixture.py)
        bed.run_in(1, ["python", "-c", "..."])         a command inside host 1's namespace
        bed.slow_link(1, 20_000_000); bed.cut_link(1); bed.restore_link(1)
        bench.netbed_probes.measure_tcp_rate(bed, 0, 1)  # bytes/s of a TCP stream host 0 -> host 1

    with NetBed(BedSpec(redis_port=6380)) as bed:      the head's GCS keeps its tables in Redis (`bench.netbed_gcs`)
        gcs = bed.kill_gcs(); bed.restart_gcs(gcs)     SIGKILL the GCS, exec it again: the cluster goes on

Each host's Ray has its own `--temp-dir` (/tmp/hsbed/<slot>/h<i>), `--node-ip-address` (its
namespace's address), one CPU, a custom resource `host<i>` (for placing work on a host), no
dashboard. Drivers run *inside* a host's namespace (`run_in`): a Ray driver needs a raylet on its own
node, and the bridge has no address, so the root namespace cannot reach any host and no host can
reach anything but the bed's own addresses. A driver passes `_node_ip_address=` its host's address
to `ray.init` (without it, a driver on host 1 attached to the head's raylet). Token auth is on, as
in deploy/: a fresh token per bed in its own file (`RAY_AUTH_TOKEN_PATH`), never ~/.ray, passed to
every process of the bed by `env`.

Teardown kills exactly the processes inside the bed's namespaces (`ip netns pids`), then deletes
namespaces, veths, bridge and the bed's directory; it is idempotent. A bed belongs to a slot
locked (flock) by its owner for its lifetime: a crashed owner's lock is gone, so the next bed on
that slot, or `down`, removes what it left. (`ray stop --force` run anywhere on the machine kills
Ray processes by name in every namespace, the bed's too: not while a bed is up.)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import netbed_gcs as gcs
from bench import netbed_net as net
from bench.netbed_net import BedError, HostNet, LinkFeatureUnavailable, unavailable_reason

BIN_DIR = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]

__all__ = ["BedError", "BedSpec", "LinkFeatureUnavailable", "NetBed", "leftovers", "unavailable_reason"]


@dataclass(frozen=True)
class BedSpec:
    num_hosts: int = 3
    with_ray: bool = True
    num_cpus: int = 1  # per host
    object_store_bytes: int = 80 * 2**20
    ray_port: int = 6379  # the same on every host: each namespace has its own ports
    start_timeout_s: float = 90.0
    head_num_cpus: int | None = None  # None: num_cpus (0: nothing needing a CPU lands on the head)
    redis_port: int | None = None  # GCS fault tolerance: the head's GCS keeps its tables in a redis-server
    # on this port of host 0's loopback (`bench.netbed_gcs`); None: in the GCS's memory


def bed_dir(slot: int) -> Path:
    return net.LOCK_DIR / str(slot)


def state_path(slot: int) -> Path:
    return net.LOCK_DIR / f"slot{slot}.json"


def leftovers(slot: int, netns_inodes: list[int]) -> list[str]:
    """What of a torn-down bed still exists: namespaces, links, processes in its namespaces, its dir."""
    found = net.slot_leftovers(slot)
    found += [f"process {pid}" for pid in net.pids_in_netns_inodes(set(netns_inodes))]
    if bed_dir(slot).exists():
        found.append(f"dir {bed_dir(slot)}")
    return found


def _try_lock(slot: int):
    net.LOCK_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(net.LOCK_DIR / f"slot{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def _clear_slot(slot: int) -> list[str]:
    """With the slot's lock held: remove whatever a previous owner left there."""
    removed = net.remove_slot(slot)
    if bed_dir(slot).exists():
        shutil.rmtree(bed_dir(slot), ignore_errors=True)
        removed.append(f"dir {bed_dir(slot)}")
    state_path(slot).unlink(missing_ok=True)
    return removed


class NetBed:
    """One bed: `up()` builds it (and its Ray cluster), `down()` removes it; a context manager."""

    def __init__(self, spec: BedSpec = BedSpec()) -> None:
        self.spec = spec
        self.slot: int | None = None
        self.hosts: list[HostNet] = []
        self.netns_inodes: list[int] = []
        self._lock_fd: int | None = None
        self._children: list[subprocess.Popen] = []  # daemons started for the bed (not by `ray start`): reaped on down

    def __enter__(self) -> NetBed:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()

    @property
    def dir(self) -> Path:
        return bed_dir(self.slot)

    @property
    def head_address(self) -> str:
        return f"{self.hosts[0].address}:{self.spec.ray_port}"

    def up(self) -> NetBed:
        if reason := unavailable_reason():
            raise BedError(f"no bed on this machine: {reason}")
        for slot in range(net.NUM_SLOTS):
            if (fd := _try_lock(slot)) is not None:
                self.slot, self._lock_fd = slot, fd
                break
        else:
            raise BedError(f"all {net.NUM_SLOTS} bed slots are held by live owners (python -m bench.netbed status)")
        _clear_slot(self.slot)
        self.dir.mkdir(parents=True)
        self.hosts = net.create_hosts(self.slot, self.spec.num_hosts)
        self.netns_inodes = [net.netns_inode(h.netns) for h in self.hosts]
        with os.fdopen(os.open(self.dir / "auth_token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        self._write_state()
        if self.spec.with_ray:
            self._start_ray()
        return self

    def down(self) -> list[str]:
        """Idempotent: kill the bed's processes, delete its namespaces, links, directory; free the slot."""
        if self._lock_fd is None:
            return []
        removed = _clear_slot(self.slot)
        for child in self._children:  # killed with the namespace's processes; reaped, or it lingers as a zombie
            child.wait(timeout=10)
        os.close(self._lock_fd)
        self._lock_fd = None
        return removed

    def leftovers(self) -> list[str]:
        return leftovers(self.slot, self.netns_inodes)

    # -- running things on a host --------------------------------------------------------------

    def host(self, host: int | HostNet) -> HostNet:
        return host if isinstance(host, HostNet) else self.hosts[host]

    def env(self, host: int | HostNet) -> dict[str, str]:
        """The environment of every process of the bed on `host` (no RAY_* from the caller leaks in)."""
        h = self.host(host)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(PATH=f"{BIN_DIR}:{env.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=str(REPO_ROOT),
                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.dir / "auth_token"),
                   RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(self.dir / f"h{h.index}"),
                   GLOO_SOCKET_IFNAME=h.ifname)  # gloo would resolve the hostname to the root namespace's address
        return env

    def _argv(self, host: int | HostNet, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.host(host).netns, *argv]

    def run_in(self, host: int | HostNet, argv: list[str], timeout: float = 60.0,
               check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(self._argv(host, argv), env=self.env(host), capture_output=True, text=True,
                           timeout=timeout, cwd=REPO_ROOT)
        if check and r.returncode != 0:
            raise BedError(f"on host {self.host(host).index}: `{' '.join(argv)}` exited {r.returncode}:\n"
                           f"{r.stdout[-2000:]}{r.stderr[-3000:]}")
        return r

    def popen_in(self, host: int | HostNet, argv: list[str], extra_env: dict[str, str] | None = None,
                 **kw) -> subprocess.Popen:
        kw.setdefault("cwd", REPO_ROOT)
        return subprocess.Popen(self._argv(host, argv), env={**self.env(host), **(extra_env or {})}, **kw)

    def kill_gcs(self) -> gcs.GcsProcess:
        """SIGKILL the head's gcs_server; what `restart_gcs` needs to start it again."""
        return gcs.kill_gcs(self)

    def restart_gcs(self, killed: gcs.GcsProcess) -> None:
        """The killed GCS exec'd again (its argv, environment, cwd) in host 0's namespace: with
        `redis_port` set it reloads its tables from Redis and the cluster goes on."""
        self._children.append(gcs.restart_gcs(self, killed))

    # -- links ---------------------------------------------------------------------------------

    def slow_link(self, host: int | HostNet, rate_bit: int) -> None:
        net.shape(self.host(host), rate_bit)

    def delay_link(self, host: int | HostNet, delay_ms: float, loss_pct: float = 0.0) -> None:
        net.delay(self.host(host), delay_ms, loss_pct)

    def netem_reason(self) -> str | None:
        return net.netem_reason(self.hosts[0])

    def cut_link(self, host: int | HostNet) -> None:
        net.set_link(self.host(host), up=False)

    def restore_link(self, host: int | HostNet) -> None:
        """Link up again and unshaped."""
        net.set_link(self.host(host), up=True)
        net.unshape(self.host(host))

    # -- Ray -------------------------------------------------------------------------------------

    def _ray_start(self, h: HostNet, head: bool) -> subprocess.Popen:
        temp = self.dir / f"h{h.index}"
        temp.mkdir(exist_ok=True)
        num_cpus = self.spec.num_cpus if not head or self.spec.head_num_cpus is None else self.spec.head_num_cpus
        argv = ["ray", "start", "--node-ip-address", h.address, "--num-cpus", str(num_cpus),
                "--object-store-memory", str(self.spec.object_store_bytes), "--temp-dir", str(temp),
                "--resources", json.dumps({f"host{h.index}": 1}), "--disable-usage-stats"]
        argv += (["--head", "--port", str(self.spec.ray_port), "--include-dashboard=false"] if head
                 else ["--address", self.head_address])
        extra_env = None
        if head and self.spec.redis_port is not None:
            argv += ["--redis-password", gcs.redis_password(self.dir)]
            extra_env = gcs.head_env(self.slot, self.spec.redis_port)
        with open(temp / "ray_start.log", "w") as log:  # a file, not a pipe: Ray's daemons inherit it
            return self.popen_in(h, argv, extra_env, stdout=log, stderr=subprocess.STDOUT)

    def _start_ray(self) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        if self.spec.redis_port is not None:
            self._children.append(gcs.start_redis(self))
        self._await_start(self.hosts[0], self._ray_start(self.hosts[0], head=True), deadline)
        workers = [(h, self._ray_start(h, head=False)) for h in self.hosts[1:]]
        for h, proc in workers:
            self._await_start(h, proc, deadline)
        self.wait_for_nodes(len(self.hosts), deadline)

    def _await_start(self, h: HostNet, proc: subprocess.Popen, deadline: float) -> None:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
        if rc != 0:
            log = (self.dir / f"h{h.index}" / "ray_start.log").read_text()[-3000:]
            raise BedError(f"`ray start` on host {h.index} ({h.address}) "
                           f"{'timed out' if rc is None else f'exited {rc}'}:\n{log}")

    def ray_status(self) -> str:
        return self.run_in(0, ["ray", "status", "--address", self.head_address], check=False, timeout=30).stdout

    def num_alive_nodes(self) -> int:
        """Alive nodes as the head's GCS sees them (`ray status`'s Active section)."""
        text = self.ray_status()
        active = text.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in text else ""
        return sum(1 for line in active.splitlines() if "node_" in line)

    def wait_for_nodes(self, num_nodes: int, deadline: float) -> None:
        while (seen := self.num_alive_nodes()) < num_nodes:
            if time.monotonic() > deadline:
                raise BedError(f"{seen} of {num_nodes} Ray nodes alive after {self.spec.start_timeout_s:.0f} s; "
                               f"`ray status`:\n{self.ray_status()}")
            time.sleep(0.5)

    def _write_state(self) -> None:
        state = {"slot": self.slot, "owner_pid": os.getpid(), "dir": str(self.dir),
                 "head_address": self.head_address,
                 "netns_inodes": self.netns_inodes, "hosts": [asdict(h) for h in self.hosts]}
        state_path(self.slot).write_text(json.dumps(state))

    def state(self) -> dict:
        return json.loads(state_path(self.slot).read_text())


# -- CLI ---------------------------------------------------------------------------------------------

def _status() -> int:
    num_shown = 0
    for slot in range(net.NUM_SLOTS):
        held = (fd := _try_lock(slot)) is None
        if fd is not None:
            os.close(fd)
        state = json.loads(state_path(slot).read_text()) if state_path(slot).exists() else None
        left = net.slot_leftovers(slot)
        if held or state or left:
            owner = f"held by pid {state['owner_pid'] if state else '?'}" if held else "no live owner"
            hosts = " ".join(h["address"] for h in state["hosts"]) if state else "-"
            print(f"slot {slot}: {owner}; hosts {hosts}; {len(left)} namespaces/links/routes")
            num_shown += 1
    if not num_shown:
        print("no bed")
    return 0


def _down() -> int:
    num_removed = 0
    for slot in range(net.NUM_SLOTS):
        if (fd := _try_lock(slot)) is None:
            print(f"slot {slot}: held by a live owner, left alone (stop it with Ctrl-C or SIGTERM)")
            continue
        try:
            for what in _clear_slot(slot):
                print(f"slot {slot}: removed {what}")
                num_removed += 1
        finally:
            os.close(fd)
    for what in net.remove_probes():
        print(f"removed {what} (a probe whose process is gone)")
        num_removed += 1
    if not num_removed:
        print("nothing to remove")
    return 0


def _up(args) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SIGTERM tears down like Ctrl-C
    t0 = time.monotonic()
    with NetBed(BedSpec(num_hosts=args.hosts, with_ray=not args.no_ray)) as bed:
        print(json.dumps({**bed.state(), "up_s": round(time.monotonic() - t0, 2)}), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.netbed", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a bed and hold it until Ctrl-C / SIGTERM (prints its state as JSON)")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--no-ray", action="store_true", help="namespaces and links only")
    sub.add_parser("status", help="list the slots")
    sub.add_parser("down", help="remove every bed whose owner is gone")
    args = p.parse_args(argv)
    if args.cmd != "status" and (reason := unavailable_reason()):
        print(f"no bed on this machine: {reason}", file=sys.stderr)
        return 2
    return {"up": lambda: _up(args), "status": _status, "down": _down}[args.cmd]()


if __name__ == "__main__":
    sys.exit(main())
