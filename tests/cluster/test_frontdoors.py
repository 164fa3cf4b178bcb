"""Several front doors on one cluster: a second front door (and a restarted driver) attaches to
the running cluster by name; killing one of two front doors mid-load loses none of the other's
requests; the detached controller owns the replicas (they outlive a front door)."""

import os
import tempfile
import threading

import pytest

from tests.conftest import make_prompt
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(400)]

ENGINE = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=32 * 2**20)


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    import ray

    from cluster.config import ClusterConfig
    from cluster.control.ray_cluster import start_local_ray
    from cluster.frontdoor.backend import ClusterBackend

    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rd", dir="/tmp")
    start_local_ray(num_cpus=2)
    config = ClusterConfig(num_replicas=2, name="doors-test")
    owner = ClusterBackend(tiny_dir, ENGINE, config)
    yield owner, config
    owner.shutdown()
    ray.shutdown()


def test_a_second_front_door_attaches_by_name_and_leaving_stops_nothing(cluster, tiny_dir):
    from cluster.frontdoor.backend import ClusterBackend

    owner, config = cluster
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = make_prompt(400, 31)
    cold, holder = owner.generate(prompt, params)
    other = ClusterBackend(tiny_dir, ENGINE, config)  # a restarted driver would do the same
    assert not other.owns_cluster and other.replica_ids == owner.replica_ids
    warm, served = other.generate(prompt, params)  # the shared index: the resend hits through the other door
    assert warm.token_ids == cold.token_ids and warm.num_cached_tokens == 384 and served == holder
    other.shutdown()  # a front door leaving stops nothing
    again, _ = owner.generate(prompt, params)
    assert again.token_ids == cold.token_ids and owner.replica_ids == other.replica_ids


@pytest.mark.chaos  # a front door killed mid-load: make chaos
def test_killing_one_of_two_front_doors_mid_load_loses_none_of_the_others_requests(cluster, tiny_dir):
    import ray

    from cluster.frontdoors import start_frontdoors

    owner, config = cluster
    a, b = start_frontdoors(2, tiny_dir, ENGINE, config)
    prompts = [make_prompt(80, 500 + i) for i in range(16)]
    cold = [tuple(owner.generate(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                 cache_salt="cold")[0].token_ids)
            for p in prompts]
    doomed = a.generate_all.remote(prompts, 16)
    survivor = b.generate_all.remote(prompts, 16)
    killer = threading.Timer(0.5, lambda: ray.kill(a, no_restart=True))
    killer.start()
    assert ray.get(survivor, timeout=300) == cold  # every request of b completes, outputs as cold
    killer.join()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed)
    assert len(owner.replica_ids) == 2 and owner.counters["replica_deaths"] == 0
    ray.kill(b)


def test_requests_on_an_idle_cluster_spread_over_both_replicas(cluster):
    """Regression: ties broke by replica id, so an idle cluster sent everything to replica-0."""
    owner, _ = cluster
    served = [owner.generate(make_prompt(40, 700 + i), SamplingParams(temperature=0.0,
                                                                      max_tokens=1))[1] for i in range(12)]
    assert set(served) == set(owner.replica_ids)
