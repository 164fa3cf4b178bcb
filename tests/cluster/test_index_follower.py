"""A front door's read replica of the index, through real Ray: it follows the service actor's op
log and decides as the service does; a waiting `follow` blocks no event push (its own
concurrency group); a killed service invalidates it (routing falls back) and the restarted
instance's snapshot replaces it."""

import time

import pytest
import ray

from cache_service.block_hash import RequestBlockHashes
from cache_service.messages import BlockRecord, EventBatchMsg, LoadReportMsg, RecordKind, RouteRequestMsg
from cache_service.simulate import make_tokens

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(180)]

GROUPS = ["full:16", "mamba:64"]


def _wait(predicate, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _store(prompt_hashes, upto_tokens: int) -> tuple:
    """Records storing the prompt's first `upto_tokens` tokens (full blocks + the Mamba key there)."""
    full = tuple(BlockRecord(RecordKind.STORED, h, 0b01) for h in prompt_hashes[: upto_tokens // 16])
    return full + (BlockRecord(RecordKind.STORED, prompt_hashes[upto_tokens // 16 - 1], 0b10),)


def test_the_read_replica_follows_the_service_and_survives_its_restart(ray_session):
    ray = ray_session
    from cluster.control.service_actor import start_cache_service
    from cluster.frontdoor.routing_client import RoutingClient

    name = "follower-test-service"
    service = start_cache_service(name, None, GROUPS, "lossless", "fp", "hybrid", None, 0)
    for r in ("a", "b"):
        ray.get(service.add_replica.remote(r))
    client = RoutingClient(name, None, 16, "fp", seed=0, client_id="door-1")
    mirror, follower = client.mirror.shards[0], client.followers[0]
    tokens = make_tokens(512, 7, 1000)
    hashes = RequestBlockHashes(16, tokens, model_fingerprint="fp").hashes
    records = _store(hashes, 256)
    reply = ray.get(service.ingest.remote(EventBatchMsg("a", 0, len(records), records, LoadReportMsg(0, 0, 10, 0))))
    assert reply.accepted

    end = ray.get(service.stats.remote())["log_end_seq"]
    _wait(lambda: mirror.ready and mirror.cursor >= end, what="the read replica to catch up")
    msg = RouteRequestMsg(tuple(hashes), len(tokens), None, 8, dry_run=True)
    here, there = mirror.route(msg), ray.get(service.route_many.remote([msg]))[0]
    assert (here.replica_id, here.expected_hit_tokens) == (there.replica_id, there.expected_hit_tokens) == ("a", 256)

    # a waiting follow blocks no push: the push returns and wakes it (a single-threaded service
    # would hold the push behind the 60-s wait, and both gets below would time out)
    waiting = service.follow.remote(end, 60.0)
    more = tuple(r for r in _store(hashes, 384) if r not in records)
    ingest = service.ingest.remote(EventBatchMsg("a", len(records), len(records) + len(more), more,
                                                 LoadReportMsg(0, 0, 10, 0)))
    assert ray.get(ingest, timeout=30).accepted
    assert len(ray.get(waiting, timeout=30).ops) >= 1

    # decisions made here book their load at the service (and come back to no one twice)
    end = ray.get(service.stats.remote())["log_end_seq"]
    _wait(lambda: mirror.cursor >= end, what="the read replica to catch up")
    want = 3 * (len(tokens) - 384 + 8)  # three decisions, each hitting 384 tokens (on "a", or moved to "b")
    for _ in range(3):
        assert client.mirror.route(RouteRequestMsg(tuple(hashes), len(tokens), None, 8)).expected_hit_tokens == 384

    def booked_at_service():
        return sum(load["queued_tokens"] for load in ray.get(service.stats.remote())["loads"].values())

    assert sum(mirror.state.loads.current.values()) == want
    _wait(lambda: booked_at_service() >= want, what="the read replica's bookings to reach the service")
    end = ray.get(service.stats.remote())["log_end_seq"]
    _wait(lambda: mirror.cursor >= end, what="the read replica to catch up")
    assert booked_at_service() == sum(mirror.state.loads.current.values()) == want

    # the service dies: the read replica stops deciding at once, then loads the new instance
    epoch = mirror.epoch
    snapshots = follower.num_snapshots
    ray.kill(service, no_restart=False)
    _wait(lambda: follower.num_snapshots > snapshots and mirror.ready and mirror.epoch != epoch,
          timeout_s=60, what="a snapshot of the restarted service")
    assert follower.num_failures >= 1
    assert set(mirror.state.index.replicas) == set()  # the restarted service knows nothing yet
    assert mirror.state.index.num_entries == 0
    client.close()
    ray.kill(service, no_restart=True)


def test_a_sharded_index_is_routed_over_every_shards_read_replica(ray_session):
    """Two shards through Ray: each replica's events go to its own shard only; the front door's
    copies of both decide with the hit held on either; a dead shard stops decisions (by load,
    never on a copy the restarted shard no longer vouches for) until its snapshot is back."""
    ray = ray_session
    from cache_service.shards import shard_of, shard_service_name
    from cluster.control.service_actor import start_cache_service
    from cluster.frontdoor.routing_client import RoutingClient

    name = "sharded-test-service"
    shards = [start_cache_service(shard_service_name(name, k), None, GROUPS, "lossless", "fp", "hybrid", None, 0)
              for k in range(2)]
    ids = {}
    for i in range(8):  # one replica on each shard at least
        ids.setdefault(shard_of(f"rep-{i}", 2), f"rep-{i}")
    assert len(ids) == 2
    tokens = make_tokens(512, 9, 1000)
    hashes = RequestBlockHashes(16, tokens, model_fingerprint="fp").hashes
    for k, rid in ids.items():
        ray.get(shards[k].add_replica.remote(rid))
        records = _store(hashes, 128 * (k + 2))  # shard 1's replica holds the longer prefix
        assert ray.get(shards[k].ingest.remote(EventBatchMsg(rid, 0, len(records), records))).accepted
    client = RoutingClient(name, None, 16, "fp", seed=0, client_id="door-s", num_shards=2)
    ends = [ray.get(s.stats.remote())["log_end_seq"] for s in shards]
    _wait(lambda: client.mirror.ready and all(m.cursor >= e for m, e in zip(client.mirror.shards, ends)),
          what="both shards' read replicas")
    decision = client.mirror.route(RouteRequestMsg(tuple(hashes), len(tokens), None, 8, dry_run=True))
    assert (decision.replica_id, decision.expected_hit_tokens) == (ids[1], 384)
    assert {e.replica_id: e.hit_tokens for e in decision.estimates} == {ids[0]: 256, ids[1]: 384}
    assert ray.get(shards[0].stats.remote())["replicas"].keys() == {ids[0]}  # each shard: its own only

    epoch = client.mirror.shards[1].epoch
    ray.kill(shards[1], no_restart=False)
    _wait(lambda: client.mirror.shards[1].epoch != epoch and client.mirror.ready, timeout_s=60,
          what="a snapshot of the restarted shard")
    decision = client.mirror.route(RouteRequestMsg(tuple(hashes), len(tokens), None, 8, dry_run=True))
    assert decision.replica_id == ids[0]  # the restarted shard knows nothing of its replica yet
    client.close()
    for s in shards:
        ray.kill(s, no_restart=True)


def test_a_cluster_with_a_sharded_index_routes_warm_hits_on_the_front_doors_copy(ray_session, tiny_dir):
    """`cluster.cache_service.shards: 2` end to end: each replica pushes to its own shard, the front door
    decides on its copies of both (no route call to a service), a resend is routed to the holder
    and hits there, byte-exact, and the copies converge with the replicas' caches."""
    from cluster.config import CacheServiceConfig, ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend
    from tests.conftest import make_prompt
    from workers.engine.config import EngineConfig
    from workers.engine.sampling_params import SamplingParams

    config = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=64 * 2**20)
    backend = ClusterBackend(tiny_dir, config, ClusterConfig(
        name=None, num_replicas=2, cache_service=CacheServiceConfig(shards=2)))
    try:
        assert backend.routing.num_shards == 2
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        prompt = make_prompt(600, 3)
        cold, holder = backend.generate(prompt, params)
        _wait(lambda: not backend.index_problems(), timeout_s=60, what="the copies to converge")
        warm, again = backend.generate(prompt, params)
        assert again == holder and warm.num_cached_tokens == 576 and warm.token_ids == cold.token_ids
        assert warm.num_computed_prompt_tokens == 600 - 576
        assert backend.routing.counters["decided_here"] >= 1 and backend.routing.batcher.num_calls == 0
        shards = [ray.get(backend.routing.shard(k).stats.remote())["replicas"].keys() for k in range(2)]
        assert sorted(r for s in shards for r in s) == sorted(backend.replica_ids)  # each on one shard only
    finally:
        backend.shutdown()
