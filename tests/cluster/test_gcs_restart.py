"""The head's GCS killed and started again under traffic (issue 30, item 5), on a 3-host bed whose
head keeps its GCS tables in a real redis-server (`BedSpec(redis_port=...)`, `bench.netbed_gcs`):
the front door, controller and cache service on host 0 (no CPU there), one replica on each worker
host (`gcs_restart_driver`). Greedy requests stream from 3 clients throughout; the GCS is SIGKILLed,
left down a few seconds, and exec'd again with its argv and environment (as KubeRay restarts it).

Asserted: requests keep finishing while the GCS is down (serving never asks the GCS); the control
plane answers again (every node alive, a named actor found) and a fresh request is served within
a bound; the replicas are the same processes (pids asked of them) and kept their caches (a warm
prefix still hits, its tokens unchanged); a new replica starts (actor and placement group creation
need the GCS) and serves the cold output; every request finished with its cold output, on the
first try or after a retryable error (HTTP 503) - none wrong, none lost to another error, none hung.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from bench.netbed import BedSpec, NetBed
from bench.netbed_driver import BedDriver
from bench.netbed_gcs import redis_reason
from tests.cluster.netbed_fixture import require_netbed

pytestmark = [pytest.mark.chaos, pytest.mark.heavy, pytest.mark.timeout(180)]

REDIS_PORT = 6380
DOWN_S = 4.0  # the GCS stays down this long (raylets wait 60 s: RAY_gcs_rpc_server_reconnect_timeout_s)
MAX_DOWN_S = 30.0  # waiting longer for a request to finish meanwhile: well within the raylets' 60 s
RESUME_BOUND_S = 45.0  # a bound, not a measurement


@pytest.fixture(scope="module")
def redis_bed():
    require_netbed()
    if reason := redis_reason():
        pytest.skip(f"GCS fault tolerance needs Redis: {reason}")
    with NetBed(BedSpec(num_hosts=3, head_num_cpus=0, redis_port=REDIS_PORT)) as bed:
        yield bed
    assert bed.leftovers() == [], "the bed left these behind"


def test_gcs_restart_keeps_replicas_and_loses_no_request(redis_bed, tiny_dir, tmp_path):
    bed = redis_bed
    argv = [sys.executable, "-m", "tests.cluster.gcs_restart_driver", bed.head_address, bed.hosts[0].address, tiny_dir]
    with open(tmp_path / "driver.log", "w+") as log:
        proc = bed.popen_in(0, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        driver = BedDriver(proc, log)
        try:
            placed = driver.read()
            num_before_kill = driver.ask(traffic=True)["num_finished"]
            t_kill = time.monotonic()
            gcs = bed.kill_gcs()
            num_at_kill = driver.ask(count=True)["num_finished"]
            while True:  # down DOWN_S at least, and until a request finished without it (a loaded machine)
                time.sleep(max(0.2, DOWN_S - (time.monotonic() - t_kill)))
                num_while_down = driver.ask(count=True)["num_finished"] - num_at_kill
                if num_while_down > 0 or time.monotonic() - t_kill > MAX_DOWN_S:
                    break
            down_s = time.monotonic() - t_kill
            bed.restart_gcs(gcs)
            after = driver.ask(restarted=True)
            assert driver.ask(stop=True) == {"stopped": True}
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
            proc.wait()
    requests = after["requests"]
    print(json.dumps({"gcs_down_s": round(down_s, 2), "finished_before_kill": num_before_kill,
                      "finished_while_gcs_down": num_while_down, "control_s": round(after["control_s"], 2),
                      "resume_s": round(after["resume_s"], 2), "requests": requests,
                      "finished_after_restart": after["finished_after_restart"], "added_s": round(after["added_s"], 2),
                      "stats": after["stats"]}))
    workers = {h.address for h in bed.hosts[1:]}
    assert {r["host"] for r in placed["replicas"].values()} == workers, placed  # one replica per worker host
    assert placed["warm"][0]["num_cached_tokens"] == 0 and placed["warm"][1]["num_cached_tokens"] > 0, placed
    assert num_while_down > 0  # serving goes on without the GCS (the front door talks to the actors directly)
    assert after["control_s"] < RESUME_BOUND_S and after["fresh_served"] and after["resume_s"] < RESUME_BOUND_S, after
    assert after["finished_after_restart"] > 0, after
    assert after["replicas"] == placed["replicas"]  # the same replicas, the same processes, on the same hosts
    assert after["warm"]["served"] == placed["holder"]
    assert after["warm"]["num_cached_tokens"] == placed["warm"][1]["num_cached_tokens"]  # its cache kept
    assert after["warm"]["tokens"] == placed["warm"][0]["tokens"]
    assert after["added_same_tokens"] and after["added_host"] in workers, after  # the GCS creates actors again
    assert requests["num_wrong"] == 0 and requests["num_hung"] == 0, requests
    assert requests["errors"] == [], requests  # none lost: every one finished, if need be on a retry
    assert requests["num_finished"] == requests["num_requests"] > 0, requests
