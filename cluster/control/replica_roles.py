"""Prefill/decode roles of the replicas (`cluster.pd`). Without it, all mixed.

A replica gets its role once, and keeps it until it is purged (its role then goes back):

    assign(id, role)   a replica started for a role (the autoscaler's UP for that role): set
                       before the replica is first listed, so no front door sees another role
    role_of(id)        any other replica, on first ask (the initial ones, a fixed count's
                       replacements, a restarted controller's adopted ones): prefill while fewer
                       than num_prefill hold it, else decode while fewer than num_decode, else
                       prefill while below max_prefill, else decode. A fixed count's replacement
                       thereby takes the role of the replica it replaces.

`loads()` is the autoscaler's per-role view (`RoleLoad`, what `control.scale_policy` decides on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cluster.pd_config import DECODE, MIXED, PREFILL, ROLES, PDConfig

__all__ = ["DECODE", "MIXED", "PREFILL", "ReplicaRoles", "RoleLoad"]


@dataclass(frozen=True)
class RoleLoad:
    """One role's replicas and requests in flight, as the autoscaler sees them."""

    replica_ids: tuple[str, ...]  # live replicas of the role, draining ones included, in id order
    num_unfinished: int  # prefill: waiting for or in prefill; decode: streams decoding


class ReplicaRoles:
    def __init__(self, pd: PDConfig) -> None:
        self.pd = pd
        self._roles: dict[str, str] = {}

    def role_of(self, replica_id: str) -> str:
        """`replica_id`'s role: assigned, or given on first ask by the rule in the module doc."""
        if not self.pd.enabled:
            return MIXED
        if replica_id not in self._roles:
            self._roles[replica_id] = self._next_role()
        return self._roles[replica_id]

    def _next_role(self) -> str:
        held = list(self._roles.values())
        num_prefill, num_decode = held.count(PREFILL), held.count(DECODE)
        if num_prefill < self.pd.num_prefill:
            return PREFILL
        if num_decode < self.pd.num_decode:
            return DECODE
        return PREFILL if num_prefill < self.pd.max_prefill else DECODE

    def assign(self, replica_id: str, role: str) -> None:
        """`replica_id` (not listed yet) holds `role` (PREFILL or DECODE) from now on."""
        if not self.pd.enabled:
            raise ValueError(f"no roles to assign: cluster.pd is off ({replica_id} would be {role})")
        if role not in ROLES:
            raise ValueError(f"no role {role!r} (roles: {', '.join(ROLES)})")
        self._roles[replica_id] = role

    def forget(self, replica_id: str) -> None:
        self._roles.pop(replica_id, None)

    def check_add(self, role: str, replica_ids: list[str], n: int, capped: bool) -> None:
        """Refuse to start `n` replicas as `role` next to the live `replica_ids`: `ValueError`
        without pd or for no such role, `RuntimeError` beyond the role's max (when `capped`)."""
        if not self.pd.enabled:
            raise ValueError(f"no role to start replicas as: cluster.pd is off (asked for {role!r})")
        lo_hi = self.pd.bounds(role)  # ValueError for no such role
        held = sum(self.role_of(r) == role for r in replica_ids)
        if capped and held + n > lo_hi[1]:
            raise RuntimeError(f"at most {lo_hi[1]} {role} replicas (cluster.pd.max_{role}), {held} running")

    def loads(self, replica_ids: list[str], requests: Mapping[str, int] | None,
              num_door_requests: int) -> dict[str, RoleLoad]:
        """Each role's `RoleLoad` over the live `replica_ids`. `requests`: in flight per replica
        (the replicas' load reports); `num_door_requests`: accepted by the front doors, unfinished.
        What the front doors hold beyond the replicas' total is on no replica yet: waiting for
        prefill, counted for the prefill role. `requests` None (the cache service does not
        answer): every role counts `num_door_requests` (no role is thought idle on a guess)."""
        out = {}
        for role in ROLES:
            ids = tuple(sorted(r for r in replica_ids if self.role_of(r) == role))
            if requests is None:
                num = num_door_requests
            else:
                num = sum(requests.get(r, 0) for r in ids)
                if role == PREFILL:
                    num += max(0, num_door_requests - sum(requests.get(r, 0) for r in replica_ids))
            out[role] = RoleLoad(ids, num)
        return out
