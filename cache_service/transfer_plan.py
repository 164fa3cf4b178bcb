"""Transfer or recompute: which replica's pages, if any, move before a request is served.

Pure policy beside `router.py`: it reads a `RouteDecision` (the service's own plan, or the
per-replica hit estimates when the target was forced or is a replica being warmed) and says what
to copy; the control plane does the copy and recomputes on any failure.
"""

from __future__ import annotations

from cache_service.messages import ReplicaEstimate, RouteDecision


def better_holder(decision: RouteDecision, target: str) -> ReplicaEstimate | None:
    """The replica that would hit more of the prompt than `target` does, or None."""
    here = decision.hit_on(target)
    holder = max(decision.estimates, key=lambda e: e.hit_tokens, default=None)
    if holder is not None and holder.replica_id != target and holder.hit_tokens > here:
        return holder
    return None


def plan_transfer(decision: RouteDecision, target: str) -> tuple[str, str, int] | None:
    """(src, dst, tokens) to move before serving on `target`: the service's plan, or the pages of
    a better holder when `target` was forced; None if nothing should move."""
    if decision.transfer is not None and decision.transfer.dst_replica == target:
        return decision.transfer.src_replica, target, decision.transfer.num_tokens
    holder = better_holder(decision, target)
    return (holder.replica_id, target, holder.hit_tokens) if holder is not None else None
