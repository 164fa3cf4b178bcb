"""Prefill/decode disaggregation's config section (YAML: `cluster.pd`, issue 31) and the role names.

    num_prefill, num_decode    replicas of each role at start (both 0, the default: all mixed)
    min_prefill, max_prefill   the autoscaler's bounds for the prefill role (None: num_prefill)
    min_decode, max_decode     ...and for the decode role (None: num_decode)
    prefill_cpus, decode_cpus  a Linux CPU list ("0", "0-3,8") each replica of the role pins its
                               process to (`workers/cpu_affinity.py`; None: no pinning)

Every bound left out fixes its role at its start count; a role with min < max is scaled by the
autoscaler within its own bounds (`control.scale_policy.decide_roles`). The cluster's own
min/max_replicas are the roles' sums (`ClusterConfig` derives and checks them).
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.cpu_affinity import CpuListError, parse_cpu_list

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"
ROLES = (PREFILL, DECODE)  # the order roles are filled in and ties between them broken
BOUND_KEYS = ("min_prefill", "max_prefill", "min_decode", "max_decode")


@dataclass(frozen=True)
class PDConfig:
    """Prefill/decode disaggregation: prefill replicas prefill each request up to its first token
    and hand it off to a decode replica, which decodes the rest. Both counts 0 (the default):
    every replica is mixed (prefills and decodes its own requests)."""

    num_prefill: int = 0
    num_decode: int = 0
    min_prefill: int | None = None  # None: num_prefill (the role's count is fixed)
    max_prefill: int | None = None  # None: num_prefill
    min_decode: int | None = None  # None: num_decode
    max_decode: int | None = None  # None: num_decode
    prefill_cpus: str | int | None = None  # None: not pinned
    decode_cpus: str | int | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError(f"replica counts must be >= 0, got num_prefill={self.num_prefill}, "
                             f"num_decode={self.num_decode}")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError(f"need both num_prefill and num_decode >= 1 (or both 0: mixed), got "
                             f"num_prefill={self.num_prefill}, num_decode={self.num_decode}")
        if not self.enabled:
            given = [key for key in BOUND_KEYS if getattr(self, key) is not None]
            if given:
                raise ValueError(f"{given[0]}={getattr(self, given[0])} needs num_prefill and num_decode >= 1 "
                                 f"(both 0: all replicas mixed, no role to bound)")
        for role in ROLES:
            self.cpus(role)  # parses, or raises naming the key
            num = getattr(self, f"num_{role}")
            for bound in ("min", "max"):
                if getattr(self, f"{bound}_{role}") is None:
                    object.__setattr__(self, f"{bound}_{role}", num)
            lo, hi = self.bounds(role)
            if self.enabled and not 1 <= lo <= num <= hi:
                raise ValueError(f"need 1 <= min_{role} <= num_{role} <= max_{role}, got min_{role}={lo}, "
                                 f"num_{role}={num}, max_{role}={hi}")

    @property
    def enabled(self) -> bool:
        return self.num_prefill > 0

    @property
    def num_replicas(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def min_replicas(self) -> int:
        return self.min_prefill + self.min_decode

    @property
    def max_replicas(self) -> int:
        return self.max_prefill + self.max_decode

    def cpus(self, role: str) -> tuple[int, ...] | None:
        """The CPUs replicas of `role` pin to (None: not pinned; always None for mixed)."""
        if role not in ROLES:
            return None
        text = getattr(self, f"{role}_cpus")
        if text is None:
            return None
        if not self.enabled:
            raise ValueError(f"{role}_cpus={text} needs num_prefill and num_decode >= 1")
        try:
            return parse_cpu_list(text)
        except CpuListError as exc:
            raise ValueError(f"{role}_cpus: {exc}") from None

    def bounds(self, role: str) -> tuple[int, int]:
        """(min, max) replicas of `role` (PREFILL or DECODE)."""
        if role not in ROLES:
            raise ValueError(f"no role {role!r} (roles: {', '.join(ROLES)})")
        return getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
