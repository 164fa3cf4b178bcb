"""Placement by expected value: which positions of a prompt get a Mamba state besides the boundaries
retention always keeps, chosen under a per-request byte budget (`--retention value:BYTES`).

    S(p)       share of recent lookups whose attention match reached >= p tokens (misses count:
               a match of 0); the last `window` lookups, so it follows the traffic
    value(Q)   recompute a later lookup saves from states at the positions Q (sorted, q_0 = 0):
                   sum_t (cost(q_t) - cost(q_{t-1})) * S(q_t)
               (a lookup whose match ends at d restores the deepest state <= d: the sum telescopes)
    choose     at most K = BYTES // state bytes positions among the candidates (aligned positions
               where matches have ended, below the prompt's end), maximizing value(chosen + B)
               with the boundaries B (replay, final, junctions and the EAGLE positions under them)
               always in: a dynamic program over the sorted candidates, as Sparse Prefix Caching's
               (arXiv 2605.05219), with B as forced points, O(K * M) for M candidates by the
               convex hull trick (`best_positions`); M is capped at `max_candidates` (the ones
               with the highest cost(p) * S(p) alone).

The chosen positions are grid states (`CheckpointPlanner.periodic`): eviction ranks them below every
boundary state until they serve a hit, so placement adds to what `latest` keeps and never takes
from it. The engine (`EngineCacheManager.try_admit`), `hybridserve simulate` and `explain` build
it through `make_retention` and feed it their lookups (`RetentionPolicy.observe`): one object, one
rule.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from cache_service.eviction_policy import RecomputeCost
from cache_service.retention_policies import RetentionPolicy
from cache_service.specs import SpecError

DEFAULT_WINDOW = 4096  # lookups the survival share is measured over
DEFAULT_MAX_CANDIDATES = 256


@dataclass
class MatchDepthStats:
    """Where the last `window` lookups' attention matches ended (aligned tokens; 0 for a miss)."""

    window: int = DEFAULT_WINDOW
    _ends: deque = field(default_factory=deque)
    _counts: Counter = field(default_factory=Counter)
    version: int = 0  # lookups observed in all

    def observe(self, match_tokens: int, alignment: int) -> None:
        self.version += 1
        end = max(0, match_tokens) // alignment * alignment
        self._ends.append(end)
        self._counts[end] += 1
        if len(self._ends) > self.window:
            old = self._ends.popleft()
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]

    def __len__(self) -> int:
        return len(self._ends)

    def survival(self, below: int) -> list[tuple[int, float]]:
        """(p, S(p)) for every position 0 < p < `below` where some match ended, ascending."""
        total = len(self._ends)
        if not total:
            return []
        out, reached = [], total
        for p in sorted(self._counts):
            if p >= below:
                break
            if p > 0:
                out.append((p, reached / total))
            reached -= self._counts[p]
        return out

    def reach_share(self, position: int) -> float:
        """S(position)."""
        total = len(self._ends)
        return sum(c for p, c in self._counts.items() if p >= position) / total if total else 0.0


def best_positions(candidates: list[tuple[int, float]], forced: Collection[int], budget: int,
                   cost: RecomputeCost, survival_at) -> tuple[int, ...]:
    """The at most `budget` candidate positions that maximize value(chosen + forced) (module doc).
    `candidates`: (p, S(p)) ascending; `survival_at(p)`: S at a forced position.

    f[k][j], the best value of a chain of points ending at point j with k free picks, is
    c_j S_j + max over i < j of (f[k'][i] - c_i S_j) (k' = k - 1 for a free j, k for a forced
    one): the best of lines of slope -c_i at x = S_j. Slopes fall as i rises and S_j falls as j
    rises, so each layer keeps its upper envelope in a deque (the convex hull trick): O(K M).
    A chain may pass over a forced point; it can only be worth less than the same chain through
    it (adding a point never lowers the value, as S falls with p), so the best chain is still an
    optimum of chosen + forced."""
    picks = {p for p, _ in candidates} - set(forced)
    if budget <= 0 or not picks:
        return ()
    points = sorted(set(forced) | picks)
    share = dict(candidates)
    pos = [0, *points]
    s = [1.0, *(share[p] if p in picks else survival_at(p) for p in points)]
    c = [cost(p) for p in pos]
    free = [False, *(p in picks for p in points)]
    n, neg = len(pos), float("-inf")
    f = [[neg] * n for _ in range(budget + 1)]
    back = [[-1] * n for _ in range(budget + 1)]
    hulls: list[deque] = [deque() for _ in range(budget + 1)]  # per layer: (slope, intercept, i)

    def add(hull: deque, m: float, b: float, i: int) -> None:
        while len(hull) >= 2:  # the last line is nowhere on top once the new one is in
            m1, b1, _ = hull[-2]
            m2, b2, _ = hull[-1]
            if (b - b1) * (m1 - m2) >= (b2 - b1) * (m1 - m):
                hull.pop()
            else:
                break
        hull.append((m, b, i))

    f[0][0] = 0.0
    add(hulls[0], -c[0], 0.0, 0)
    for j in range(1, n):
        x, need = s[j], 1 if free[j] else 0
        for k in range(need, budget + 1):
            hull = hulls[k - need]
            while len(hull) >= 2 and hull[1][0] * x + hull[1][1] >= hull[0][0] * x + hull[0][1]:
                hull.popleft()  # queries only fall: a line beaten now stays beaten
            if hull:
                m, b, i = hull[0]
                f[k][j], back[k][j] = m * x + b + c[j] * x, i
        for k in range(need, budget + 1):
            if f[k][j] > neg:
                add(hulls[k], -c[j], f[k][j], j)
    _, k, j = max((f[k][j], -k, j) for k in range(budget + 1) for j in range(n))  # ties: fewer states
    k = -k
    chosen = []
    while j > 0:
        if free[j]:
            chosen.append(pos[j])
        j, k = back[k][j], k - (1 if free[j] else 0)
    return tuple(sorted(chosen))


@dataclass(frozen=True, eq=False)
class ValuePlacement(RetentionPolicy):
    """`value:BYTES`: per request, at most BYTES of states past the boundaries, placed by the
    dynamic program over the observed match depths (module doc)."""

    max_states: int
    budget_bytes: int = 0
    cost: RecomputeCost = field(default_factory=RecomputeCost)
    stats: MatchDepthStats = field(default_factory=MatchDepthStats)
    max_candidates: int = DEFAULT_MAX_CANDIDATES
    _last: dict = field(default_factory=dict)  # the last answer: the planner asks twice per request

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"value:{self.budget_bytes}"

    def observe(self, match_tokens: int, alignment: int) -> None:
        self.stats.observe(match_tokens, alignment)

    def periodic_positions(self, num_tokens: int, alignment: int, fixed: Collection[int] = ()) -> Iterable[int]:
        if self.max_states <= 0:
            return ()
        key = (num_tokens, alignment, frozenset(fixed), self.stats.version)
        if key in self._last:
            return self._last[key]
        candidates = [(p, s) for p, s in self.stats.survival(num_tokens + 1) if p % alignment == 0]
        if len(candidates) > self.max_candidates:
            top = sorted(candidates, key=lambda x: self.cost(x[0]) * x[1], reverse=True)[: self.max_candidates]
            candidates = sorted(top)
        forced = [p for p in fixed if 0 < p <= num_tokens]
        chosen = best_positions(candidates, forced, self.max_states, self.cost, self.stats.reach_share)
        self._last.clear()
        self._last[key] = chosen
        return chosen


def parse_value_placement(text: str, state_bytes: int, cost: RecomputeCost | None = None) -> ValuePlacement:
    """`value:BYTES` (BYTES may be written 3e8) -> the policy; `state_bytes`: one snapshot's bytes
    over every Mamba group."""
    try:
        budget = int(float(text.split(":", 1)[1]))
    except ValueError:
        raise SpecError(f"retention {text!r}: expected value:BYTES, e.g. value:3e8") from None
    if budget < 0:
        raise SpecError(f"retention {text!r}: BYTES must be >= 0")
    if state_bytes <= 0:
        raise SpecError(f"retention {text!r} needs the state bytes per snapshot (a Mamba group with page bytes)")
    return ValuePlacement(budget // state_bytes, budget, cost or RecomputeCost())
