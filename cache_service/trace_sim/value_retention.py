"""A byte-budgeted retention policy for the simulation: each request may add at most
`max_snapshots` periodic snapshots (its byte budget / the layout's state bytes per snapshot),
placed where they are expected to save the most prefill.

    S(p)     = share of lookups seen so far whose attention match reached >= p tokens
    value(p) = p * S(p)          (tokens saved by a snapshot at p, times how often a later
                                  request sharing a prefix gets that far)

Candidates are the multiples of the alignment at which matches have ended (in the trace, block
boundaries). Learned online from the lookups the simulation has made, so it uses no future.
The mandatory boundaries (replay, final, junctions) are kept by the planner as always.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from cache_service.retention import RetentionPolicy


@dataclass
class MatchDepthStats:
    """Where lookups' attention matches ended (aligned tokens), including misses (0)."""

    ends: list[int] = field(default_factory=list)  # sorted

    def observe(self, match_tokens: int, alignment: int) -> None:
        bisect.insort(self.ends, match_tokens // alignment * alignment)

    def reach_share(self, position: int) -> float:
        if not self.ends:
            return 0.0
        return (len(self.ends) - bisect.bisect_left(self.ends, position)) / len(self.ends)


@dataclass(frozen=True, eq=False)
class ExpectedValueRetention(RetentionPolicy):
    stats: MatchDepthStats
    max_snapshots: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"value:{self.max_snapshots}"

    def periodic_positions(self, num_tokens: int, alignment: int) -> Iterable[int]:
        if self.max_snapshots <= 0:
            return ()
        candidates = sorted({p for p in self.stats.ends if 0 < p <= num_tokens})
        scored = sorted(((p * self.stats.reach_share(p), p) for p in candidates), reverse=True)
        return sorted(p for value, p in scored[: self.max_snapshots] if value > 0)


def parse_value_retention(text: str, state_bytes_per_snapshot: int) -> ExpectedValueRetention | None:
    """`value:BYTES` -> the policy with BYTES of periodic snapshots per request; None otherwise."""
    if not text.startswith("value:"):
        return None
    try:
        budget = int(float(text.split(":", 1)[1]))
    except ValueError:
        raise ValueError(f"retention {text!r}: expected value:BYTES (e.g. value:2e9)") from None
    if budget < 0 or state_bytes_per_snapshot <= 0:
        raise ValueError(f"retention {text!r}: needs a layout with state pages and BYTES >= 0")
    return ExpectedValueRetention(MatchDepthStats(), budget // state_bytes_per_snapshot)
