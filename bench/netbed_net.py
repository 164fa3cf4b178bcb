"""The network half of the multi-host test bed (`bench.netbed`): Linux network namespaces joined
by veth links on one bridge, shaped with `tc` and cut with `ip link`.

    slot s (0..7)   one bed; held by an flock on /tmp/hsbed/slot<s>.lock for its owner's lifetime
    hsbed<s>-br     the bridge (root namespace, no address: the root namespace cannot reach a host)
    hsbed<s>-h<i>   host i's namespace: lo and hsbed<s>-e<i>, address 10.213.<s>.<i+1>/24
    hsbed<s>-v<i>   host i's veth end on the bridge

         hsbed<s>-h0            hsbed<s>-h1
        [e0 10.213.s.1]       [e1 10.213.s.2]     ...
             |  veth               |  veth
        [v0]-+----- hsbed<s>-br ---+-[v1]

A host has one route, its /24 on the link: no default route, so nothing outside the bed's own
addresses can be contacted from inside. The root namespace gets an `unreachable` route for the
/24, so a stray connect from outside the bed fails at once instead of leaving by the default route.
Everything here is named by the slot's prefix, so cleanup is by name (`remove_slot`), idempotent,
and also removes what a crashed owner left behind.
Needs root and iproute2; `unavailable_reason()` says why a bed cannot be made here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NUM_SLOTS = 8
SUBNET_PREFIX = "10.213"  # 10.213.<slot>.0/24: checked against every other interface before use
LOCK_DIR = Path("/tmp/hsbed")
NETEM_MISSING = "this kernel has no netem qdisc"


class BedError(RuntimeError):
    """A bed step failed; the message carries the command and its output."""


class LinkFeatureUnavailable(BedError):
    """The kernel lacks a qdisc the bed was asked for (netem here); the message says which."""


@dataclass(frozen=True)
class HostNet:
    index: int
    netns: str  # the host's namespace
    veth: str  # its end on the bridge (root namespace)
    ifname: str  # its end inside the namespace
    address: str


def prefix(slot: int) -> str:
    return f"hsbed{slot}-"


def bridge_name(slot: int) -> str:
    return f"{prefix(slot)}br"


def subnet(slot: int) -> str:
    return f"{SUBNET_PREFIX}.{slot}.0/24"


def host_net(slot: int, index: int) -> HostNet:
    p = prefix(slot)
    return HostNet(index, f"{p}h{index}", f"{p}v{index}", f"{p}e{index}", f"{SUBNET_PREFIX}.{slot}.{index + 1}")


def sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise BedError(f"`{' '.join(argv)}` exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
    return r


def unavailable_reason() -> str | None:
    """Why no bed can be made on this machine (not root, no iproute2, no namespaces, veth, bridge or
    tbf), or None. Probes each with a throwaway namespace, bridge and veth named hsbp<pid>*."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc); CI runs as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2"
    ns, br, veth = f"hsbp{os.getpid()}", f"hsbp{os.getpid()}b", f"hsbp{os.getpid()}v"
    steps = [("create a network namespace", ("ip", "netns", "add", ns)),
             ("run in a network namespace", ("ip", "netns", "exec", ns, "true")),
             ("create a bridge", ("ip", "link", "add", br, "type", "bridge")),
             ("create a veth pair", ("ip", "link", "add", veth, "type", "veth", "peer", "name", "e0", "netns", ns)),
             ("shape a link with tbf", ("tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", "1mbit",
                                        "burst", "16k", "latency", "50ms"))]
    try:
        for what, argv in steps:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            if r.returncode != 0:
                return f"cannot {what}: {r.stderr.strip()}"
        return None
    finally:
        remove_probes(os.getpid())


def remove_probes(pid: int | None = None) -> list[str]:
    """Delete the probe namespace and links of `pid`, or of every probing process no longer alive."""
    def stale(name: str) -> bool:
        digits = re.match(r"hsbp(\d+)", name)
        return bool(digits) and (int(digits.group(1)) == pid if pid else not Path(f"/proc/{digits.group(1)}").exists())

    removed = []
    for name in (n for n in netns_names() if stale(n)):
        sh("ip", "netns", "del", name, check=False)  # its veth end goes with it
        removed.append(f"netns {name}")
    for name in (n for n in link_names() if stale(n)):
        sh("ip", "link", "del", name, check=False)
        removed.append(f"link {name}")
    return removed


def netns_names() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def link_names() -> list[str]:
    out = sh("ip", "-o", "link", "show", check=False).stdout
    return [m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)", out, re.M)]


def foreign_addresses_in(slot: int) -> list[str]:
    """Addresses in the slot's subnet held by an interface that is not the bed's."""
    out = sh("ip", "-o", "-4", "addr", "show", check=False).stdout
    return [line for line in out.splitlines()
            if f" {SUBNET_PREFIX}.{slot}." in line and prefix(slot) not in line]


def netns_pids(netns: str) -> list[int]:
    r = sh("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def kill_netns_processes(netns: str, grace_s: float = 1.0) -> None:
    """SIGTERM every process in `netns`, SIGKILL what is left after `grace_s` (Ray's workers can take
    10 s to go on SIGTERM; a bed keeps nothing worth a clean exit), wait until none is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in netns_pids(netns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while netns_pids(netns) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not netns_pids(netns):
            return
    raise BedError(f"processes still in {netns} after SIGKILL: {netns_pids(netns)}")


def netns_inode(netns: str) -> int:
    return os.stat(f"/run/netns/{netns}").st_ino


def pids_in_netns_inodes(inodes: set[int]) -> list[int]:
    """Every live process whose network namespace is one of `inodes` (a leak check after teardown)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def create_hosts(slot: int, num_hosts: int) -> list[HostNet]:
    """The bridge and `num_hosts` namespaces on it, each up with its address and one link route."""
    if clash := foreign_addresses_in(slot):
        raise BedError(f"subnet {subnet(slot)} is already in use here: {clash}")
    if held := sh("ip", "route", "show", "exact", subnet(slot), check=False).stdout.strip():
        raise BedError(f"subnet {subnet(slot)} is already routed here: {held}")
    sh("ip", "route", "add", "unreachable", subnet(slot))
    br = bridge_name(slot)
    sh("ip", "link", "add", br, "type", "bridge")
    sh("ip", "link", "set", br, "up")
    hosts = [host_net(slot, i) for i in range(num_hosts)]
    for h in hosts:
        sh("ip", "netns", "add", h.netns)
        sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", h.ifname, "netns", h.netns)
        sh("ip", "link", "set", h.veth, "master", br, "up")
        inside = ("ip", "netns", "exec", h.netns, "ip")
        sh(*inside, "link", "set", "lo", "up")
        sh(*inside, "addr", "add", f"{h.address}/24", "dev", h.ifname)
        sh(*inside, "link", "set", h.ifname, "up")
    return hosts


def remove_slot(slot: int) -> list[str]:
    """Kill every process in the slot's namespaces, delete the namespaces, veths and bridge.
    Idempotent: absent pieces are skipped. Returns what was removed."""
    removed = []
    for ns in (n for n in netns_names() if n.startswith(prefix(slot))):
        kill_netns_processes(ns)
        sh("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    deadline = time.monotonic() + 5.0  # a deleted namespace's veths go asynchronously
    while links := [n for n in link_names() if n.startswith(prefix(slot))]:
        if time.monotonic() > deadline:
            raise BedError(f"links of slot {slot} still there after deleting them: {links}")
        for link in links:
            if sh("ip", "link", "del", link, check=False).returncode == 0:
                removed.append(f"link {link}")
        time.sleep(0.02)
    if _our_route(slot):
        sh("ip", "route", "del", "unreachable", subnet(slot), check=False)
        removed.append(f"route unreachable {subnet(slot)}")
    return removed


def _our_route(slot: int) -> bool:
    return sh("ip", "route", "show", "exact", subnet(slot), check=False).stdout.startswith("unreachable")


def slot_leftovers(slot: int) -> list[str]:
    """Namespaces, links and the root namespace's route of the slot that still exist."""
    return ([f"netns {n}" for n in netns_names() if n.startswith(prefix(slot))]
            + [f"link {n}" for n in link_names() if n.startswith(prefix(slot))]
            + ([f"route unreachable {subnet(slot)}"] if _our_route(slot) else []))


# -- shaping and cutting: a host's link is both its veth ends, so each direction is shaped ----------

def _ends(h: HostNet) -> list[tuple[tuple[str, ...], str]]:
    return [(("tc",), h.veth), (("ip", "netns", "exec", h.netns, "tc"), h.ifname)]


def shape(h: HostNet, rate_bit: int, burst_bytes: int | None = None) -> None:
    """Token-bucket (tbf) both directions of the host's link to `rate_bit` bits/s."""
    burst = burst_bytes or max(16 * 1024, rate_bit // 8 // 100)  # >= one 10 ms tick of tokens
    for tc, dev in _ends(h):
        sh(*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bit}bit",
           "burst", str(burst), "latency", "100ms")


def delay(h: HostNet, delay_ms: float, loss_pct: float = 0.0) -> None:
    """netem delay (and loss) on both directions; LinkFeatureUnavailable where the kernel lacks netem."""
    args = ["delay", f"{delay_ms}ms"] + (["loss", f"{loss_pct}%"] if loss_pct else [])
    for tc, dev in _ends(h):
        r = sh(*tc, "qdisc", "replace", "dev", dev, "root", "netem", *args, check=False)
        if r.returncode != 0:
            unshape(h)
            raise LinkFeatureUnavailable(f"{NETEM_MISSING} (`tc qdisc ... netem`: {r.stderr.strip()})")


def unshape(h: HostNet) -> None:
    for tc, dev in _ends(h):
        sh(*tc, "qdisc", "del", "dev", dev, "root", check=False)  # absent root qdisc: nothing to do


def netem_reason(h: HostNet) -> str | None:
    """None where netem works on this kernel, else why not (probed on the host's bridge end)."""
    r = sh("tc", "qdisc", "replace", "dev", h.veth, "root", "netem", "delay", "1ms", check=False)
    if r.returncode != 0:
        return f"{NETEM_MISSING} (`tc qdisc ... netem`: {r.stderr.strip()})"
    sh("tc", "qdisc", "del", "dev", h.veth, "root", check=False)
    return None


@dataclass(frozen=True)
class LinkBytes:
    sent: int  # by the host, onto the bridge
    received: int


def link_bytes(h: HostNet) -> LinkBytes:
    """The host's link counters, read at its bridge end (whose rx is what the host sent)."""
    stats = Path(f"/sys/class/net/{h.veth}/statistics")
    return LinkBytes(int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))


def set_link(h: HostNet, up: bool) -> None:
    """Cut (down) or restore (up) the host's veth on the bridge: no frame reaches or leaves the host."""
    sh("ip", "link", "set", h.veth, "up" if up else "down")
