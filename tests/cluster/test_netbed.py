"""The multi-host test bed (`bench.netbed`): 3 hosts as network namespaces on one bridge, a Ray node
in each; shaping a link caps the bytes/s a TCP stream measures, cutting it stops traffic until it
is restored, and neither a clean teardown nor a crashed owner leaves a namespace, veth, bridge,
route, directory or process behind. Skipped with the reason where namespaces cannot be made.
Every test on the module's bed is marked heavy: the bed starts a Ray node in each of 3 namespaces."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from bench import netbed_net
from bench.netbed import BedSpec, NetBed, leftovers
from bench.netbed_probes import measure_tcp_rate, try_connect
from tests.cluster import netbed_fixture

netbed = netbed_fixture.netbed  # the module's bed (a fixture, used by name)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.heavy
def test_each_host_routes_only_the_bed_subnet(netbed):
    for h in netbed.hosts:
        routes = netbed.run_in(h, ["ip", "-4", "route"]).stdout.strip().splitlines()
        assert routes == [f"{netbed_net.subnet(netbed.slot)} dev {h.ifname} proto kernel scope link src {h.address}"]
    root = subprocess.run(["ip", "route", "get", netbed.hosts[0].address], capture_output=True, text=True)
    assert root.returncode != 0 and "No route to host" in root.stderr  # the root namespace has no way in


@pytest.mark.heavy
def test_ray_has_one_node_per_host_at_its_address(netbed):
    r = netbed.run_in(1, [sys.executable, "-m", "tests.cluster.netbed_driver", "nodes", netbed.head_address,
                          str(len(netbed.hosts)), netbed.hosts[1].address], timeout=90)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    addresses = [h.address for h in netbed.hosts]
    assert out["nodes"] == sorted(addresses)
    assert out["driver"] == addresses[1]
    assert out["pinned"] == addresses  # the task pinned to host i ran at host i's address


@pytest.mark.heavy
def test_slow_link_caps_measured_throughput(netbed):
    rate_bit = 20_000_000
    unshaped = measure_tcp_rate(netbed, 1, 2, seconds=0.5) * 8
    netbed.slow_link(2, rate_bit)
    try:
        inbound = measure_tcp_rate(netbed, 1, 2, seconds=1.5) * 8
        outbound = measure_tcp_rate(netbed, 2, 1, seconds=1.5) * 8
    finally:
        netbed.restore_link(2)
    assert unshaped > 4 * rate_bit, unshaped
    for measured in (inbound, outbound):  # tbf counts frames, TCP counts payload: ~0.96 of the rate here
        assert 0.25 * rate_bit < measured < 1.5 * rate_bit, (measured, rate_bit)
    assert measure_tcp_rate(netbed, 1, 2, seconds=0.5) * 8 > 4 * rate_bit  # restored


@pytest.mark.heavy
def test_cut_link_stops_traffic_until_restored(netbed):
    gcs = (0, netbed.spec.ray_port)  # a real listener: host 0's Ray GCS
    assert try_connect(netbed, 1, *gcs).ok
    netbed.cut_link(1)
    try:
        cut = try_connect(netbed, 1, *gcs, timeout_s=1.0)
    finally:
        netbed.restore_link(1)
    assert not cut.ok, "connected across a cut link"  # timed out here (the SYN is dropped at the cut)
    assert try_connect(netbed, 1, *gcs, timeout_s=5.0).ok
    assert try_connect(netbed, 2, *gcs).ok


@pytest.mark.heavy
def test_netem_delay_where_the_kernel_has_it(netbed):
    if reason := netbed.netem_reason():
        with pytest.raises(netbed_net.LinkFeatureUnavailable, match="no netem"):
            netbed.delay_link(1, 50)
        pytest.skip(f"delay and loss not emulated: {reason}")
    gcs = (0, netbed.spec.ray_port)
    assert try_connect(netbed, 1, *gcs).seconds < 0.05
    netbed.delay_link(1, 50)
    try:
        delayed = try_connect(netbed, 1, *gcs, timeout_s=5.0)
    finally:
        netbed.restore_link(1)
    assert delayed.ok and delayed.seconds > 0.095  # the SYN and the SYN-ACK each wait 50 ms on the link


@pytest.mark.heavy
def test_a_task_on_host_b_reaches_an_actor_on_host_a_across_the_veth(netbed):
    """Driver on host 0; the actor pinned to host 1 (A), the task to host 2 (B), by NodeAffinity; the
    payload the task hands the actor leaves B by its veth."""
    a, b, num_bytes = netbed.hosts[1], netbed.hosts[2], 4 * 2**20
    before = netbed_net.link_bytes(b)
    r = netbed.run_in(0, [sys.executable, "-m", "tests.cluster.netbed_driver", "cross", netbed.head_address,
                          netbed.hosts[0].address, a.address, b.address, str(num_bytes)], timeout=90)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"task": b.address, "actor": a.address,
                                                             "bytes": num_bytes}
    assert netbed_net.link_bytes(b).sent - before.sent >= num_bytes


@pytest.mark.heavy
def test_gloo_pair_channel_crosses_the_veth(netbed):
    """`PairChannel` rank 0 in host 1 (hosting the store), rank 1 in host 2: the tensor arrives whole,
    and host 1's link carried it."""
    a, b, num_bytes = netbed.hosts[1], netbed.hosts[2], 8 * 2**20
    driver = [sys.executable, "-m", "tests.cluster.netbed_driver"]
    before = netbed_net.link_bytes(a)
    sender = netbed.popen_in(a, [*driver, "gloo-send", a.address, str(num_bytes)], stdout=subprocess.PIPE,
                             text=True)
    try:
        port = json.loads(sender.stdout.readline())["port"]
        r = netbed.run_in(b, [*driver, "gloo-recv", a.address, str(port), str(num_bytes)], timeout=90)
        assert json.loads(r.stdout.strip().splitlines()[-1]) == {"equal": True, "bytes": num_bytes}
        assert json.loads(sender.stdout.readline()) == {"sent": num_bytes}
        assert sender.wait(timeout=30) == 0
    finally:
        sender.kill()
        sender.wait()
    assert netbed_net.link_bytes(a).sent - before.sent >= num_bytes


def test_unavailable_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(netbed_net.os, "geteuid", lambda: 1000)
    assert "needs root" in netbed_net.unavailable_reason()
    monkeypatch.setattr(netbed_net.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netbed_net.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert netbed_net.unavailable_reason() == "`tc` not found: install iproute2"
    monkeypatch.setattr(netbed_fixture, "unavailable_reason", netbed_net.unavailable_reason)
    with pytest.raises(pytest.skip.Exception, match="multi-host bed unavailable: `tc` not found"):
        netbed_fixture.require_netbed()  # what every bed test does first


def test_down_kills_the_bed_processes_and_is_idempotent():
    netbed_fixture.require_netbed()
    bed = NetBed(BedSpec(num_hosts=2, with_ray=False)).up()
    try:
        sleeper = bed.popen_in(1, ["sleep", "600"])
        deadline = time.monotonic() + 10
        while sleeper.pid not in netbed_net.pids_in_netns_inodes(set(bed.netns_inodes)):  # until it entered
            assert time.monotonic() < deadline and sleeper.poll() is None
            time.sleep(0.02)
        removed = bed.down()
        for what in [f"netns {h.netns}" for h in bed.hosts] + [f"link {netbed_net.bridge_name(bed.slot)}",
                                                               f"route unreachable {netbed_net.subnet(bed.slot)}"]:
            assert what in removed  # (a veth goes with its namespace, or is deleted if still there)
        assert sleeper.wait(timeout=5) == -signal.SIGTERM
        assert bed.leftovers() == []
        assert bed.down() == [] and bed.leftovers() == []
    finally:
        bed.down()


def test_remove_probes_deletes_those_of_dead_processes_only():
    netbed_fixture.require_netbed()
    dead = "hsbp9999999"  # above any pid_max: no live process owns it
    netbed_net.sh("ip", "netns", "add", dead)
    netbed_net.sh("ip", "link", "add", f"{dead}b", "type", "bridge")
    assert netbed_net.remove_probes() == [f"netns {dead}", f"link {dead}b"]
    assert not [n for n in netbed_net.netns_names() + netbed_net.link_names() if n.startswith(dead)]


@pytest.mark.heavy
def test_a_crashed_owner_leaves_nothing_after_down():
    """`up` killed with SIGKILL (no teardown runs): its Ray nodes live on in their namespaces until
    `python -m bench.netbed down` removes the bed, and nothing of it is left."""
    netbed_fixture.require_netbed()
    owner = subprocess.Popen([sys.executable, "-m", "bench.netbed", "up", "--hosts", "1"], stdout=subprocess.PIPE,
                             text=True)
    state = None
    try:
        state = json.loads(owner.stdout.readline())
        owner.kill()
        owner.wait(timeout=10)
        orphans = netbed_net.pids_in_netns_inodes(set(state["netns_inodes"]))
        assert orphans  # the Ray processes outlived their owner
        down = subprocess.run([sys.executable, "-m", "bench.netbed", "down"], capture_output=True, text=True,
                              timeout=60)
        assert down.returncode == 0, down.stderr
        assert f"slot {state['slot']}: removed netns" in down.stdout
        assert leftovers(state["slot"], state["netns_inodes"]) == []
    finally:
        owner.kill()
        if state is not None:
            subprocess.run([sys.executable, "-m", "bench.netbed", "down"], capture_output=True, timeout=60)
