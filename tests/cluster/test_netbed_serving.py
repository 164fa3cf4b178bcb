"""Serving across hosts on the multi-host bed (`bench.netbed`): a hybridserve cluster whose front
door runs in host 0 (`netbed_serve_driver`) places its 2 replicas on 2 different hosts
(`ReplicaSet.spread`), its controller and cache service on host 0 (the front door's node); a prompt served cold on
its holder and then forced onto the other replica is served there from the holder's pages, moved
over the veth links between the two hosts (their byte counters grow by at least the pages' bytes),
with the same greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import netbed_net
from tests.cluster import netbed_fixture
from tests.cluster.netbed_serve_driver import CONFIG, PROMPT_LEN

netbed = netbed_fixture.netbed  # the module's bed (a fixture, used by name)

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(90)]

HIT = (PROMPT_LEN - 1) // 64 * 64  # 576: the tiny model hits in 64-token units, below the last token


def _read(driver: subprocess.Popen, log) -> dict:
    line = driver.stdout.readline()
    if not line:
        driver.wait(timeout=30)
        log.seek(0)
        raise AssertionError(f"the driver exited {driver.returncode}:\n{log.read()[-4000:]}")
    return json.loads(line)


def _page_bytes(model_dir: str, num_tokens: int) -> int:
    from bench.gpu_check_measure import prefix_nbytes
    from workers.engine.engine import LLMEngine

    return prefix_nbytes(LLMEngine.from_checkpoint(model_dir, CONFIG).cache, num_tokens)


def test_a_warm_hit_crosses_hosts_as_a_page_transfer_over_the_veth(netbed, tiny_dir, tmp_path):
    by_address = {h.address: h for h in netbed.hosts}
    argv = [sys.executable, "-m", "tests.cluster.netbed_serve_driver", netbed.head_address,
            netbed.hosts[0].address, tiny_dir]
    with open(tmp_path / "driver.log", "w+") as log:
        driver = netbed.popen_in(0, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            placed = _read(driver, log)
            before = {h.index: netbed_net.link_bytes(h) for h in netbed.hosts}
            driver.stdin.write("transfer\n")
            driver.stdin.flush()
            forced = _read(driver, log)
            after = {h.index: netbed_net.link_bytes(h) for h in netbed.hosts}
            driver.stdin.write("stop\n")
            driver.stdin.flush()
            assert _read(driver, log) == {"stopped": True}
            assert driver.wait(timeout=60) == 0
        finally:
            driver.kill()
            driver.wait()
    holder = by_address[placed["replicas"][placed["holder"]]]
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
