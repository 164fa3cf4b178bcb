"""A cluster's replica actors and their placement groups as Ray holds them: detached and named
(`cluster.ids`), so they are found by name (a restarted controller adopts them, `shutdown`
sweeps them) and stopped here, the actor killed and its placement group removed together.
"""

from __future__ import annotations

import ray

from cluster.ids import placement_group_name, replica_actor_prefix, replica_id, replica_number


def named_replicas(cluster_name: str, namespace: str | None) -> dict[str, object]:
    """The cluster's live replica actors, by id (found by their names)."""
    prefix = replica_actor_prefix(cluster_name)
    out = {}
    for name in ray.util.list_named_actors():
        n = replica_number(name, prefix)
        if n is not None:
            try:
                out[replica_id(n)] = ray.get_actor(name, namespace=namespace)
            except ValueError:  # died meanwhile
                pass
    return out


def replica_groups(service_name: str) -> dict[str, object]:
    """The cluster's replica placement groups not removed yet, by replica id."""
    from ray.util.placement_group import get_placement_group, placement_group_table

    prefix = placement_group_name(service_name, replica_id(0))[:-1]
    out = {}
    for group in placement_group_table().values():
        n = replica_number(group.get("name") or "", prefix)
        if n is not None and group.get("state") != "REMOVED":
            try:
                out[replica_id(n)] = get_placement_group(group["name"])
            except ValueError:  # removed meanwhile
                pass
    return out


def stop_replica(actor, pg) -> None:
    """Kill a replica actor and remove its placement group (either may be None; already gone: fine)."""
    from ray.util.placement_group import remove_placement_group

    try:
        if actor is not None:
            ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass
