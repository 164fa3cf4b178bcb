"""Verification: where the cache service's index differs from the live replicas' caches.

Used by tests and `python -m bench.faults` to time recovery: no stale or dead replica, and each
live replica's entry counts and next event seq equal its own cache's at one instant (events
still in flight show as a difference until pushed, at most one engine step or heartbeat later).
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError

TIMEOUT_S = 10.0


def index_problems(replicas, services, mirrors=None) -> list[str]:
    """`replicas`: a membership view (`get`, `ids`); `services`: the cache-service actor handle, or
    every shard's; `mirrors`: the front door's read replicas of them (each must have followed its
    shard's log up to where it stood when its stats were taken)."""
    services = list(services) if isinstance(services, (list, tuple)) else [services]
    problems = []
    reps = {r: replicas.get(r) for r in replicas.ids}
    refs = {r: rep.actor.cache_summary.remote() for r, rep in reps.items() if rep is not None}
    taken = {}
    for rid, ref in refs.items():
        try:
            taken[rid] = ray.get(ref, timeout=TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - dead, unhealthy, or slow: not consistent
            problems.append(f"{rid}: unreachable ({type(exc).__name__})")
    try:
        every = ray.get([s.stats.remote() for s in services], timeout=TIMEOUT_S)
    except (RayActorError, GetTimeoutError):
        return problems + ["cache service unreachable"]
    stats = {r: v for shard in every for r, v in shard["replicas"].items()}
    for k, (mirror, shard) in enumerate(zip(mirrors or (), every)):
        if mirror.epoch != shard["epoch"]:
            problems.append(f"the front door's read replica of shard {k} is not ready")
        elif mirror.cursor < shard["log_end_seq"]:
            problems.append(f"the front door's read replica of shard {k} is behind "
                            f"(op {mirror.cursor} of {shard['log_end_seq']})")
    problems += [f"{r}: indexed but not a live replica" for r in stats if r not in reps]
    for rid, (entries, next_seq) in taken.items():
        s = stats.get(rid)
        if s is None:
            problems.append(f"{rid}: not in the index")
        elif s["stale"]:
            problems.append(f"{rid}: stale (waiting for a resync)")
        elif s["next_seq"] != next_seq or s["entries"] != entries:
            problems.append(f"{rid}: index has seq {s['next_seq']} entries {s['entries']}, "
                            f"replica seq {next_seq} entries {entries}")
    return problems
