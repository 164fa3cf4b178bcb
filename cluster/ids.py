"""The names of a cluster's actors and of the ids the front door mints, in one place.

    "<cluster>-controller"              the detached controller (a restarted server reattaches by it)
    "<cluster>-cache-service"           the cache-service actor (the index and routing)
    "<cluster>-frontdoor-<port>"        an extra front-door actor (`cluster.frontdoors`)
    "<cluster>-<replica id>"            a replica actor (detached: a restarted controller finds it
                                        again by this name, `replica_actor_prefix`)
    "<cache service>-<replica id>"      a replica's placement group (detached, likewise)
    "frontdoor-<8 hex>"                 a front door's id in the controller's load book
    "<8 hex>"                           a controller's epoch (each start and restart: a new one)
    "cmpl-<24 hex>", "chatcmpl-<24 hex>"  OpenAI response ids

Request and replica ids: `cache_service.ids` (the engine and the trace simulator mint them too).
"""

from __future__ import annotations

import secrets
import uuid

from cache_service.ids import new_request_id, replica_id

__all__ = ["completion_id", "controller_name", "frontdoor_actor_name", "new_cluster_name", "new_controller_epoch",
           "new_frontdoor_id", "new_request_id", "placement_group_name", "replica_actor_name", "replica_actor_prefix",
           "replica_id", "replica_number", "service_name"]


def controller_name(cluster_name: str) -> str:
    return f"{cluster_name}-controller"


def service_name(cluster_name: str) -> str:
    return f"{cluster_name}-cache-service"


def frontdoor_actor_name(cluster_name: str, port: int) -> str:
    return f"{cluster_name}-frontdoor-{port}"


def placement_group_name(service: str, replica: str) -> str:
    return f"{service}-{replica}"


def replica_actor_name(cluster_name: str, replica: str) -> str:
    return f"{cluster_name}-{replica}"


def replica_actor_prefix(cluster_name: str) -> str:
    """What every replica actor name of `cluster_name` starts with (followed by the number only)."""
    return replica_actor_name(cluster_name, replica_id(0))[:-1]


def replica_number(name: str, prefix: str = replica_id(0)[:-1]) -> int | None:
    """n of a name `prefix` + "<n>" (a replica id, actor or placement group name); None if not one."""
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


def new_frontdoor_id() -> str:
    return f"frontdoor-{secrets.token_hex(4)}"


def new_controller_epoch() -> str:
    return secrets.token_hex(4)


def completion_id(kind: str) -> str:
    """`kind`: "cmpl" (completions) or "chatcmpl" (chat completions)."""
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def new_cluster_name() -> str:
    """A fresh cluster (no name given: nothing to reattach to)."""
    return f"hybridserve-{secrets.token_hex(4)}"
