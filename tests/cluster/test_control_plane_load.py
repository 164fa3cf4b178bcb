"""The reproduced control-plane failure, on the shipped `configs/local.yaml` (2 replicas, max 2):
hundreds of concurrent streams (more than the 64 threads a replica once had for everything) are
all queued and served, health checks keep answering beside them (their own concurrency group),
no replica is purged, the autoscaler never goes beyond `max_replicas`, and a replica that stops
answering is purged *and stopped* (it was once left running beside its replacement)."""

import os
import tempfile
import threading
import time

import pytest

from cluster.config_loader import load_config
from tests.conftest import make_prompt
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    import ray

    from cluster.serve import build_backend

    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    # an eager autoscaler (a tick every 0.2 s, up at 2 requests per replica): it must still stop at max
    config = load_config("configs/local.yaml", ["cluster.num_cpus=2", "cluster.scale_up_queue_depth=2",
                                                "cluster.autoscale_interval_s=0.2"])
    backend, autoscaler, embedded = build_backend(config, tiny_dir)
    yield backend, autoscaler, config
    autoscaler.stop()
    backend.shutdown()
    ray.shutdown()


def test_300_concurrent_streams_are_queued_served_and_nobody_is_purged(cluster):
    import ray

    backend, autoscaler, config = cluster
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [make_prompt(48 + i % 5, 200 + i) for i in range(300)]
    streams = [backend.submit(p, params) for p in prompts]  # none refused: queued
    # while 300 streams are open (150 per replica, beyond the old 64 threads), control calls answer
    for rid in backend.replica_ids:
        assert ray.get(backend.replicas.get(rid).actor.ping.remote(), timeout=120) == rid
    outs = [list(s) for s in streams]
    for out in outs:
        assert out[-1].finished and len(out[-1].token_ids) == 12
        assert [t for o in out for t in o.new_token_ids] == list(out[-1].token_ids)  # none lost, none twice
    counters = backend.counters
    assert counters["replica_deaths"] == 0 and counters["retries"] == 0
    assert len(backend.replica_ids) == config.cluster.max_replicas == 2
    assert not [e for e in autoscaler.history if e.action.value == "up"]  # already at max: nothing added


@pytest.mark.chaos  # a replica frozen: make chaos
def test_a_replica_that_stops_answering_is_purged_and_stopped_and_replaced_within_max(tiny_dir):
    """A replica whose health checks stall is purged after `health_max_missed` misses, its actor
    is stopped (a call to it fails as dead), requests in flight elsewhere complete, and the
    replica count never exceeds max_replicas while the autoscaler replaces it (the controller runs
    it, and then no restarter: one death never starts two replicas)."""
    import ray
    from ray.exceptions import RayActorError

    from bench.fault_doubles import FaultyReplica
    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend
    from workers.engine.config import EngineConfig

    if not ray.is_initialized():
        from cluster.control.ray_cluster import start_local_ray

        start_local_ray(num_cpus=2)
    engine = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=32 * 2**20)
    scaling = {"min_replicas": 1, "max_replicas": 2, "scale_up_queue_depth": 0.5, "autoscale_interval_s": 0.2}
    backend = ClusterBackend(tiny_dir, engine, ClusterConfig(name=None, num_replicas=2, health_interval_s=0.3,
                                                             health_timeout_s=0.5, health_max_missed=2, **scaling),
                             replica_cls=FaultyReplica)
    counts: list[int] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            counts.append(len(backend.replicas.replicas))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    try:
        watcher.start()
        victim = backend.replica_ids[0]
        actor = backend.replicas.get(victim).actor
        streams = [backend.submit(make_prompt(64, 300 + i), SamplingParams(temperature=0.0, max_tokens=8,
                                                                           ignore_eos=True))
                   for i in range(12)]
        ray.get(actor.stall_health_checks.remote())
        deadline = time.monotonic() + 120
        while victim in backend.replica_ids and time.monotonic() < deadline:
            time.sleep(0.1)
        assert victim not in backend.replica_ids
        with pytest.raises(RayActorError):  # stopped, not left running
            ray.get(actor.describe.remote(), timeout=60)
        for s in streams:  # requests on the victim were retried elsewhere
            assert list(s)[-1].finished
        assert backend.counters["replica_deaths"] == 1 and backend.counters["replica_restarts"] == 0
    finally:
        stop.set()
        watcher.join()
        backend.shutdown()
    assert counts and min(counts) >= 1 and max(counts) <= 2, counts  # within [min, max] at every sample
