"""Prefill/decode roles of the replicas (`cluster.pd`): each replica takes a role when the
controller first lists it, prefill until `num_prefill` replicas hold it, then decode; a purged
replica's role goes back, so its replacement takes the same one. Without `cluster.pd`, all mixed."""

from __future__ import annotations

from cluster.config import PDConfig

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"


class ReplicaRoles:
    def __init__(self, pd: PDConfig) -> None:
        self.pd = pd
        self._roles: dict[str, str] = {}

    def role_of(self, replica_id: str) -> str:
        """`replica_id`'s role, assigned on first ask (the lesser-filled role, prefill first)."""
        if not self.pd.enabled:
            return MIXED
        if replica_id not in self._roles:
            num_prefill = sum(role == PREFILL for role in self._roles.values())
            self._roles[replica_id] = PREFILL if num_prefill < self.pd.num_prefill else DECODE
        return self._roles[replica_id]

    def forget(self, replica_id: str) -> None:
        self._roles.pop(replica_id, None)
