"""The cache service as a Ray actor: one writer thread for events, resyncs and routes, and a
concurrency group of its own for read replicas following its op log.

    default group (1 thread)   ingest, resync_chunk, route_many, note_routed, snapshot, ...
    "follow" group             follow(cursor, wait_s): waits on the log's condition for new ops, so
                               a front door's read replica hears of each op as it is applied
                               without polling, and its wait blocks no event and no route
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cache_service.messages import IndexOpsMsg
from cache_service.service import CacheService

FOLLOW_GROUP = "follow"
MAX_FOLLOWERS = 32  # front doors waiting at once (more wait their turn)


class CacheServiceActor(CacheService):
    can_wait = True

    @ray.method(concurrency_group=FOLLOW_GROUP)
    def follow(self, cursor: int, wait_s: float = 0.0) -> IndexOpsMsg:
        return self.log.since(cursor, wait_s)


def start_cache_service(name: str, namespace: str | None, *args, detached: bool = False, **kwargs):
    """The named, restartable service actor (`CacheService(*args, **kwargs)`) on the caller's node;
    `detached`: it outlives its creator (the controller's: a restarted controller finds it by name)."""
    extra = {"lifetime": "detached", "get_if_exists": True} if detached else {}
    # on the creator's node (the controller's, the head's): Ray puts an actor needing no resources on
    # a random node otherwise, and ignores a soft affinity for it (seen on the multi-host bed)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(concurrency_groups={FOLLOW_GROUP: MAX_FOLLOWERS})(CacheServiceActor).options(
        name=name, namespace=namespace, num_cpus=0, max_restarts=-1, max_task_retries=0,
        scheduling_strategy=here, **extra,
    ).remote(*args, **kwargs)
