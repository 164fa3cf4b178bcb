"""A fixed-size cluster keeps its count, on a real 2-replica local Ray cluster (no autoscaler):
a replica whose engine loop dies (or whose actor is killed) is purged, its requests in flight
finish elsewhere with their cold output, and a replacement with a new id is started, registered
with the cache service and seen by the front door; it serves a request exactly as a cold run
does at temperature 0. A replica removed on purpose is not replaced."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import make_prompt
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.chaos, pytest.mark.timeout(300)]  # replicas replaced: make chaos

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONFIG = EngineConfig(kernels="torch", max_model_len=1024, cache_memory_bytes=48 * 2**20)
DEADLINE_S = 120.0  # bound on waiting for the replacement (never reached when it works)


def _backend(tiny_dir):
    from bench.fault_doubles import FaultyReplica
    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend

    return ClusterBackend(tiny_dir, CONFIG, ClusterConfig(name=None, num_replicas=2, health_interval_s=0.5),
                          replica_cls=FaultyReplica)


def _replaced(backend, victim: str) -> str:
    """Wait until the front door sees two replicas again, `victim` gone; the replacement's id."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        ids = backend.replica_ids  # the front door's membership: it moves only on a version bump
        if victim not in ids and len(ids) == 2:
            break
        time.sleep(0.1)
    ids = backend.replica_ids
    assert victim not in ids and len(ids) == 2, ids
    return ids


def _check_replacement(ray, backend, survivor: str, victim_actor, prompt, cold) -> str:
    from prometheus_client import generate_latest
    from ray.exceptions import RayActorError

    from cluster.http.metrics import Metrics

    (new,) = set(backend.replica_ids) - {survivor}
    assert new in backend.service_stats()["replicas"]  # registered with the cache service: routable
    out, served = backend.generate(prompt, PARAMS, cache_salt="on-the-replacement", replica_id=new)
    assert served == new and out.num_cached_tokens == 0 and out.token_ids == cold
    counters = backend.counters
    assert counters["replica_deaths"] == 1 and counters["replica_restarts"] == 1
    metrics = Metrics()
    backend.attach_metrics(metrics)
    text = generate_latest(metrics.registry).decode()
    assert "hybridserve_replica_restarts_total 1.0" in text and "hybridserve_replica_deaths_total 1.0" in text
    with pytest.raises(RayActorError):  # the dead one was stopped, not left running beside it
        ray.get(victim_actor.describe.remote(), timeout=60)
    return new


def test_a_dead_engine_loop_is_purged_its_requests_finish_and_a_replacement_serves(ray_session, tiny_dir):
    ray = ray_session
    backend = _backend(tiny_dir)
    try:
        prompts = [make_prompt(60 + 20 * i, 170 + i) for i in range(3)]
        cold = [backend.generate(p, PARAMS, cache_salt=f"cold-{i}")[0].token_ids for i, p in enumerate(prompts)]
        victim, survivor = backend.replica_ids
        actor = backend.replicas.get(victim).actor
        ray.get(actor.inject_loop_fault.remote())  # its next step raises: every request on it is in flight then
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda ip: backend.generate(ip[1], PARAMS, cache_salt=f"warm-{ip[0]}",
                                                                replica_id=victim), enumerate(prompts)))
        assert [out.token_ids for out, _ in results] == cold
        assert all(out.finished and served != victim for out, served in results)
        assert backend.counters["retries"] >= 1  # a stream did break on the victim
        _replaced(backend, victim)
        _check_replacement(ray, backend, survivor, actor, prompts[0], cold[0])
    finally:
        backend.shutdown()


def test_a_killed_replica_is_replaced_and_one_removed_on_purpose_is_not(ray_session, tiny_dir):
    from bench.fault_doubles import kill_replica

    ray = ray_session
    backend = _backend(tiny_dir)
    try:
        prompt = make_prompt(90, 180)
        cold = backend.generate(prompt, PARAMS, cache_salt="cold")[0].token_ids
        victim, survivor = backend.replica_ids
        actor = backend.replicas.get(victim).actor
        kill_replica(backend, victim)  # nobody is told: the health checks find it
        _replaced(backend, victim)
        new = _check_replacement(ray, backend, survivor, actor, prompt, cold)
        stats = ray.get(backend.controller.stats.remote())
        assert stats["replica_slots"] == 2
        backend.remove_replica(new)  # on purpose: the count kept drops to 1, nothing replaces it
        stats = ray.get(backend.controller.stats.remote())
        assert backend.replica_ids == [survivor] and stats["replica_slots"] == 1
        assert stats["replica_deaths"] == 1 and stats["replica_restarts"] == 1
    finally:
        backend.shutdown()
