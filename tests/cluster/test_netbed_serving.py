"""Serving across hosts on the multi-host bed (`bench.netbed`): a hybridserve cluster whose front
door runs in host 0 (`netbed_serve_driver`) places its 2 replicas on 2 different hosts
(`ReplicaSet.spread`), its controller and cache service on host 0 (the front door's node); a prompt served cold on
its holder and then forced onto the other replica is served there from the holder's pages, moved
over the veth links between the two hosts (their byte counters grow by at least the pages' bytes),
with the same greedy tokens. The front door moves pages only where the link it measured beats
recomputing: with the holder's link cut to 4 Mbit/s (tbf) it recomputes instead."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import netbed_net
from bench.netbed_driver import BedDriver
from tests.cluster import netbed_fixture
from tests.cluster.netbed_serve_driver import CONFIG, PROMPT_LEN

netbed = netbed_fixture.netbed  # the module's bed (a fixture, used by name)

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(150)]

HIT = (PROMPT_LEN - 1) // 64 * 64  # 576: the tiny model hits in 64-token units, below the last token
SLOW_LINK_BIT = 4_000_000  # 0.5 MB/s: the 576-token hit's 2.1 MB take about 4 s, its prefill well under 1 s


def _page_bytes(model_dir: str, num_tokens: int) -> int:
    from bench.gpu_check_measure import prefix_nbytes
    from workers.engine.engine import LLMEngine

    return prefix_nbytes(LLMEngine.from_checkpoint(model_dir, CONFIG).cache, num_tokens)


def test_a_warm_hit_crosses_hosts_as_a_page_transfer_over_the_veth(netbed, tiny_dir, tmp_path):
    by_address = {h.address: h for h in netbed.hosts}
    argv = [sys.executable, "-m", "tests.cluster.netbed_serve_driver", netbed.head_address,
            netbed.hosts[0].address, tiny_dir]
    with open(tmp_path / "driver.log", "w+") as log:
        proc = netbed.popen_in(0, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        driver = BedDriver(proc, log)
        try:
            placed = driver.read()
            before = {h.index: netbed_net.link_bytes(h) for h in netbed.hosts}
            forced = driver.send("transfer")
            after = {h.index: netbed_net.link_bytes(h) for h in netbed.hosts}
            holder = by_address[placed["replicas"][placed["holder"]]]
            fast = driver.send("next")["fast"]
            netbed.slow_link(holder, SLOW_LINK_BIT)
            try:
                slowed = driver.send("next")
            finally:
                netbed.restore_link(holder)
            assert driver.send("stop") == {"stopped": True}
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
            proc.wait()
    other = by_address[placed["replicas"][placed["other"]]]
    assert holder != other, placed  # one replica per host
    assert placed["frontdoor"] == placed["controller"] == placed["service"] == netbed.hosts[0].address, placed
    assert placed["num_cached_tokens"] == 0
    assert forced["served"] == placed["other"] and forced["transfers"] == 1
    assert forced["tokens"] == placed["tokens"]  # byte-identical greedy output from the moved pages
    assert forced["num_cached_tokens"] == HIT and forced["num_computed_prompt_tokens"] == PROMPT_LEN - HIT
    page_bytes = _page_bytes(tiny_dir, HIT)
    assert forced["transfer_bytes"] == page_bytes > 0
    sent = after[holder.index].sent - before[holder.index].sent
    received = after[other.index].received - before[other.index].received
    print(json.dumps({"page_bytes": page_bytes, "holder": holder.address, "other": other.address,
                      "controller": placed["controller"], "service": placed["service"],
                      "holder_link_sent": sent, "other_link_received": received,
                      "links": {h.address: [after[h.index].sent - before[h.index].sent,
                                            after[h.index].received - before[h.index].received]
                                for h in netbed.hosts}}))
    assert sent >= page_bytes and received >= page_bytes  # the pages left one host and reached the other
    _assert_the_link_decides(fast, slowed)


def _assert_the_link_decides(fast: dict, slowed: dict) -> None:
    """Fast link measured: the pages move. The link slowed with tbf: the next move (still priced
    at the fast speed) measures it slow, and the one after recomputes instead, cold output all along."""
    slow, skipped = slowed["slow"], slowed["skipped"]
    print(json.dumps({"fast": fast, "slow": slow, "skipped": skipped, "links": slowed["links"]}))
    for phase in (fast, slow, skipped):
        assert phase["same_tokens"] and phase["cold_on"] != phase["served"], phase
    assert fast["move"] and fast["measured"] and fast["transfers"] == 1 and fast["skipped"] == 0
    assert fast["num_cached_tokens"] == HIT and fast["transfer_s"] < fast["recompute_s"]
    assert fast["link_bytes_per_s"] > 20 * SLOW_LINK_BIT / 8  # veth at full speed
    assert slow["move"] and slow["transfers"] == 1 and slow["num_cached_tokens"] == HIT
    assert not skipped["move"] and skipped["measured"] and skipped["transfers"] == 0 and skipped["skipped"] == 1
    assert skipped["num_cached_tokens"] == 0 and skipped["transfer_s"] > skipped["recompute_s"]
    assert skipped["link_bytes_per_s"] < 3 * SLOW_LINK_BIT / 8  # the slow sample dominates the average
    assert slowed["skipped_metric"] == 1  # /metrics: hybridserve_transfers_total{outcome="skipped_slow_link"}
