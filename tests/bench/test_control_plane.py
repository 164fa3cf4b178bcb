"""`bench.control_plane` at a small size: simulated replicas (real actors) resync into the cache
service and push churn while decisions are routed through Ray; killing the service during a
resync keeps routing going (by load) and the replica's index comes back complete."""

import os
import random
import tempfile

import pytest

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def setup():
    import ray

    from bench.control_plane import PlaneConfig, _prompts
    from bench.sim_replicas import document_hashes
    from cache_service.simulate import make_tokens
    from cluster.control.ray_cluster import start_local_ray

    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    start_local_ray(num_cpus=2)
    config = PlaneConfig(replicas=(8,), num_prefixes=16, decisions=300, num_hosts=2, resync_entries=150_000,
                         repeats=2)
    docs_tokens = [make_tokens(config.prompt_len, d, 128_000) for d in range(config.num_prefixes)]
    docs = document_hashes(config.num_prefixes, config.prompt_len, 0)
    yield config, docs, _prompts(config, docs_tokens, random.Random(0))
    ray.shutdown()


def test_simulated_replicas_are_indexed_and_routed_through_ray(setup):
    from bench.control_plane import in_process, through_ray

    config, docs, prompts = setup
    ray_side = through_ray(config, 8, docs, prompts)
    local = in_process(config, 8, docs, prompts)
    assert ray_side["entries"] >= local["entries"]  # every replica resynced, churn only adds
    assert ray_side["batches_pushed"] > 8 and ray_side["service"]["decisions_per_call"] >= 1
    copy = ray_side["read_replica"]
    assert copy["ops_followed"] > 0 and copy["follower_failures"] == 0
    for way in ("read_replica", "service"):  # every decision of every run answered
        assert all(run["decisions_per_s"] > 0 for run in ray_side[way]["runs"])
        assert len(ray_side[way]["runs"]) == config.repeats


def test_a_sharded_index_is_followed_and_routed_through_ray(setup):
    from bench.control_plane import through_ray

    config, docs, prompts = setup
    out = through_ray(config, 8, docs, prompts, num_shards=2)
    assert "service" not in out and out["read_replica"]["follower_failures"] == 0
    assert out["read_replica"]["ops_followed"] > 0


@pytest.mark.parametrize("num_shards", [1, 2])
def test_killing_the_service_during_a_resync_keeps_routing_and_the_index_recovers(setup, num_shards):
    from bench.control_plane import resync_through_ray

    config, docs, prompts = setup
    out = resync_through_ray(config, docs, prompts, kill_midway=True, num_shards=num_shards)
    assert out["decisions_while_down"] == 50  # every decision made, on the copy or by load
    assert out["router_counters"]["routed"] + out["router_counters"]["load_only"] == 50
    assert not out["stale_after"] and sum(out["entries_after"]) == config.resync_entries
    assert out["read_replica_follows_restarted"]
