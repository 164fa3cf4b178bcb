"""Controller restart, on a real 2-replica local Ray cluster with an autoscaler (min 2, max 3): the
detached controller is killed under greedy traffic through the front door and Ray restarts it.

    requests     every one finishes with its cold output (those in flight at the kill, and those
                 submitted while the controller was down): none lost
    replicas     the restarted controller adopts the very same actors: the cluster's named replica
                 actors, the live actors of the replica class and the live placement groups are
                 exactly those two (no duplicate, no orphan); the cache service is the same actor
    resumed      its health checks and autoscaler run again: a replica killed after the restart is
                 found, purged and replaced (BELOW_MIN), the count within [min, max] throughout
    shutdown     still stops every replica actor, placement group and the cache service

A fixed-size cluster (no autoscaler) whose replica dies with the controller: the restarted one
adopts the survivor, stops the dead one's placement group, drops it from the cache service's
index and starts a replacement with a new id (ids are never reused) to keep `num_replicas`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import make_prompt
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.chaos, pytest.mark.timeout(180)]  # controller loss: make chaos

ENGINE = EngineConfig(kernels="torch", max_model_len=1024, cache_memory_bytes=48 * 2**20)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NAME = "ctl-restart-test"
NUM_REQUESTS = 8
DEADLINE_S = 90.0  # bound on waiting for the restart / the replacement (never reached when it works)


def _live(ray, name: str = NAME) -> dict:
    """What of the cluster is alive in the GCS: named replica actors, actors of the replica class,
    replica placement groups, the cache service's actor id."""
    from ray._private.state import actors
    from ray.util.placement_group import placement_group_table

    from cluster.ids import placement_group_name, replica_actor_prefix, replica_id, service_name

    alive = [a for a in actors().values() if a["State"] == "ALIVE"]
    pg_prefix = placement_group_name(service_name(name), replica_id(0))[:-1]
    return {"named": sorted(n for n in ray.util.list_named_actors() if n.startswith(replica_actor_prefix(name))),
            "replica_actors": sorted(a["ActorID"] for a in alive if a["ActorClassName"].endswith("Replica")),
            "groups": sorted(g["name"] for g in placement_group_table().values()
                             if g["name"].startswith(pg_prefix) and g["state"] != "REMOVED"),
            "service": sorted(a["ActorID"] for a in alive if a["Name"] == service_name(name))}


def _actor_ids(backend) -> dict[str, str]:
    return {r: backend.replicas.get(r).actor._actor_id.hex() for r in backend.replica_ids}


def _restarted(ray, backend, epoch: str) -> dict:
    """The restarted controller's stats, once it answers (a new epoch: `kill` is asynchronous, the
    old one may answer first); calls while Ray restarts it fail and are asked again."""
    from ray.exceptions import ActorUnavailableError

    stats: dict = {}
    def answered() -> bool:
        nonlocal stats
        try:
            stats = ray.get(backend.controller.stats.remote(), timeout=DEADLINE_S)
        except ActorUnavailableError:
            return False
        return stats["epoch"] != epoch

    _wait(answered, "the controller restarted")
    return stats


def _wait(predicate, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {DEADLINE_S} s: {what}")


def test_a_restarted_controller_adopts_its_replicas_loses_no_request_and_resumes(ray_session, tiny_dir):
    from bench.fault_doubles import FaultyReplica, kill_controller, kill_replica
    from cluster.config import ClusterConfig
    from cluster.control.autoscaler import ScaleReason
    from cluster.frontdoor.backend import ClusterBackend

    ray = ray_session
    config = ClusterConfig(name=NAME, num_replicas=2, min_replicas=2, max_replicas=3, health_interval_s=0.5,
                           autoscale_interval_s=0.5, scale_up_queue_depth=1000, scale_down_idle_s=3600)
    backend = ClusterBackend(tiny_dir, ENGINE, config, replica_cls=FaultyReplica)
    try:
        prompts = [make_prompt(40 + 8 * i, 700 + i) for i in range(NUM_REQUESTS)]
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            cold = list(pool.map(lambda p: backend.generate(p, PARAMS, cache_salt="cold")[0].token_ids, prompts))
        before, live_before = _actor_ids(backend), _live(ray)
        assert len(before) == 2 and len(live_before["replica_actors"]) == 2 and len(live_before["groups"]) == 2
        assert len(live_before["service"]) == 1
        epoch = ray.get(backend.controller.stats.remote())["epoch"]

        # greedy traffic; the controller killed while it streams; more requests while it is down
        first = [backend.submit(p, PARAMS, cache_salt=f"a-{i}") for i, p in enumerate(prompts)]
        assert not next(iter(first[0])).finished  # streaming when the controller dies
        t_kill = time.monotonic()
        kill_controller(backend)
        second = [backend.submit(p, PARAMS, cache_salt=f"b-{i}") for i, p in enumerate(prompts)]
        stats = _restarted(ray, backend, epoch)  # rebuilt: adopted, health checks running
        back_s = time.monotonic() - t_kill
        finals = [list(stream)[-1] for stream in first + second]
        assert all(o.finished for o in finals) and [o.token_ids for o in finals] == cold + cold  # none lost

        assert stats["restarted"] and stats["replicas_adopted"] == 2
        assert stats["num_replicas"] == 2 and stats["replica_deaths"] == 0
        backend.replicas.refresh()
        assert backend.replicas.epoch == stats["epoch"]
        assert _actor_ids(backend) == before  # the same actors, adopted
        assert _live(ray) == live_before  # no duplicate, no orphan; the same cache service

        # health checks and the autoscaler resumed: a replica killed now is found and replaced
        victim = backend.replica_ids[0]
        t_victim = time.monotonic()
        kill_replica(backend, victim)
        counts = []

        def replaced() -> bool:
            counts.append(ray.get(backend.controller.stats.remote())["num_replicas"])
            backend.replicas.refresh()
            return victim not in backend.replica_ids and len(backend.replica_ids) == 2

        _wait(replaced, f"{victim} replaced")
        replaced_s = time.monotonic() - t_victim
        assert all(1 <= n <= 3 for n in counts)  # one below min only until replaced, never above max
        history: list = []
        _wait(lambda: history.extend(ray.get(backend.controller.autoscale_history.remote())) or history,
              "the autoscaler's step done (it warms the new replica after it joined)")
        assert [e.reason for e in history] == [ScaleReason.BELOW_MIN] and history[0].replica_id not in before
        stats = ray.get(backend.controller.stats.remote())
        assert stats["replica_deaths"] == 1 and stats["num_replicas"] == 2
        (new,) = set(backend.replica_ids) - set(before)
        out, served = backend.generate(prompts[1], PARAMS, cache_salt="on-the-replacement", replica_id=new)
        assert served == new and out.token_ids == cold[1]
        live = _live(ray)
        assert len(live["named"]) == len(live["replica_actors"]) == len(live["groups"]) == 2
        print(f"controller back {back_s:.2f} s after the kill; {len(finals)} of {len(finals)} requests "
              f"finished as cold; a replica killed after it replaced in {replaced_s:.2f} s")
    finally:
        backend.shutdown()
    live = _live(ray)
    assert live == {"named": [], "replica_actors": [], "groups": [], "service": []}, live


def test_a_replica_that_died_with_the_controller_is_replaced_and_its_leftovers_removed(ray_session, tiny_dir):
    from bench.fault_doubles import kill_controller, kill_replica
    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend

    ray, name = ray_session, f"{NAME}-fixed"
    backend = ClusterBackend(tiny_dir, ENGINE, ClusterConfig(name=name, num_replicas=2, health_interval_s=30))
    try:
        prompt = make_prompt(70, 900)
        cold = backend.generate(prompt, PARAMS, cache_salt="cold")[0].token_ids
        victim, survivor = backend.replica_ids
        epoch = ray.get(backend.controller.stats.remote())["epoch"]
        kill_replica(backend, victim)  # its placement group stays; the index still lists it
        kill_controller(backend)  # before a health check could see the replica's death
        stats = _restarted(ray, backend, epoch)
        assert stats["restarted"] and stats["replicas_adopted"] == 1
        assert stats["num_replicas"] == stats["replica_slots"] == 2
        backend.replicas.refresh()
        assert backend.replica_ids == [survivor, "replica-2"]  # a new id: replica-0 is not minted again
        assert sorted(backend.service_stats()["replicas"]) == backend.replica_ids  # the dead one dropped
        live = _live(ray, name)
        assert len(live["named"]) == len(live["replica_actors"]) == len(live["groups"]) == 2, live
        out, served = backend.generate(prompt, PARAMS, cache_salt="new", replica_id="replica-2")
        assert served == "replica-2" and out.token_ids == cold
    finally:
        backend.shutdown()
    assert _live(ray, name) == {"named": [], "replica_actors": [], "groups": [], "service": []}
