"""A dead engine loop on a real 2-replica local Ray cluster: the replica reports itself unhealthy,
the front door purges it and every request in flight there finishes on the other replica with
the output a healthy cluster gives (nothing lost, nothing duplicated)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import make_prompt
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.chaos, pytest.mark.timeout(300)]  # a dead engine loop: make chaos

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONFIG = EngineConfig(kernels="torch", max_model_len=1024, cache_memory_bytes=48 * 2**20)


def test_dead_engine_loop_makes_the_replica_unhealthy_and_requests_finish_elsewhere(ray_session, tiny_dir):
    from bench.fault_doubles import FaultyReplica
    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend

    ray = ray_session
    backend = ClusterBackend(tiny_dir, CONFIG, ClusterConfig(name=None, num_replicas=2), replica_cls=FaultyReplica)
    try:
        prompts = [make_prompt(60 + 20 * i, 70 + i) for i in range(4)]
        cold = [backend.generate(p, PARAMS, cache_salt=f"cold-{i}")[0].token_ids for i, p in enumerate(prompts)]
        victim, other = backend.replica_ids
        actor = backend.replicas.get(victim).actor
        assert ray.get(actor.health.remote()) is None
        ray.get(actor.inject_loop_fault.remote())
        with ThreadPoolExecutor(len(prompts)) as pool:  # all forced to the victim
            results = list(pool.map(lambda ip: backend.generate(ip[1], PARAMS, cache_salt=f"warm-{ip[0]}",
                                                                replica_id=victim), enumerate(prompts)))
        assert [out.token_ids for out, _ in results] == cold
        assert all(out.finished and served != victim for out, served in results)
        assert victim not in backend.replica_ids and other in backend.replica_ids  # purged (and stopped)
        assert backend.counters["retries"] >= 1  # at least one stream broke on the victim and was retried
    finally:
        backend.shutdown()
