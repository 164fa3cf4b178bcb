"""Real Ray on loopback: two replica actors, the cache-service actor, routing by hybrid hits."""

import os

import pytest

from tests.conftest import make_prompt
from workers.engine.config import EngineConfig
from workers.replica import GenerateMsg

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    import ray

    os.environ["RAY_TMPDIR"] = str(tmp_path_factory.mktemp("ray"))
    from cluster.ray_cluster import start_local_ray

    start_local_ray(num_cpus=2)
    yield ray
    ray.shutdown()


def test_resend_routed_to_the_holder_hits_and_replica_death_loses_nothing(ray_session, tiny_dir):
    from cluster.ray_cluster import ClusterClient

    config = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=64 * 2**20)
    client = ClusterClient(tiny_dir, config, num_replicas=2)
    try:
        msg = GenerateMsg(make_prompt(600, 1), max_tokens=6, ignore_eos=True)
        cold = client.generate(msg)
        warm = client.generate(msg)
        assert cold["num_cached_tokens"] == 0
        assert warm["replica_id"] == cold["replica_id"] and warm["num_cached_tokens"] == 576
        assert warm["token_ids"] == cold["token_ids"]
        other = next(r for r in client.replicas if r != cold["replica_id"])
        forced = client.generate(msg, replica_id=other)  # the holder's pages move there first
        assert forced["replica_id"] == other and client.num_transfers == 1
        assert forced["token_ids"] == cold["token_ids"] and forced["num_cached_tokens"] == 576
        # kill the holder: the next request is retried on the survivor, nothing lost
        client.kill_replica(cold["replica_id"])
        again = client.generate(msg, replica_id=cold["replica_id"])
        assert again["replica_id"] == other and again["token_ids"] == cold["token_ids"]
        assert again["num_cached_tokens"] == 576 and client.num_retries == 1
        stats = ray_session.get(client.service.stats.remote())
        assert list(stats["replicas"]) == [other]
    finally:
        client.shutdown()
