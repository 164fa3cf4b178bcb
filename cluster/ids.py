"""The names of a cluster's actors and of the ids the front door mints, in one place.

    "<cluster>-controller"              the detached controller (a restarted server reattaches by it)
    "<cluster>-cache-service"           the cache-service actor (the index and routing)
    "<cluster>-frontdoor-<port>"        an extra front-door actor (`cluster.frontdoors`)
    "<cache service>-<replica id>"      a replica's placement group
    "frontdoor-<8 hex>"                 a front door's id in the controller's load book
    "cmpl-<24 hex>", "chatcmpl-<24 hex>"  OpenAI response ids

Request and replica ids: `cache_service.ids` (the engine and the trace simulator mint them too).
"""

from __future__ import annotations

import secrets
import uuid

from cache_service.ids import new_request_id, replica_id

__all__ = ["completion_id", "controller_name", "frontdoor_actor_name", "new_cluster_name", "new_frontdoor_id",
           "new_request_id", "placement_group_name", "replica_id", "service_name"]


def controller_name(cluster_name: str) -> str:
    return f"{cluster_name}-controller"


def service_name(cluster_name: str) -> str:
    return f"{cluster_name}-cache-service"


def frontdoor_actor_name(cluster_name: str, port: int) -> str:
    return f"{cluster_name}-frontdoor-{port}"


def placement_group_name(service: str, replica: str) -> str:
    return f"{service}-{replica}"


def new_frontdoor_id() -> str:
    return f"frontdoor-{secrets.token_hex(4)}"


def completion_id(kind: str) -> str:
    """`kind`: "cmpl" (completions) or "chatcmpl" (chat completions)."""
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def new_cluster_name() -> str:
    """A fresh cluster (no name given: nothing to reattach to)."""
    return f"hybridserve-{secrets.token_hex(4)}"
