"""The autoscaler's policy, pure: what one step does, given what it sees (`control.autoscaler`
looks and acts). Mixed replicas: one rule over all of them (`decide`). With `cluster.pd`: the
same rule for each role over its own replicas, signal and bounds, and one action for the step
(`decide_roles`):

    role      its replicas          its signal (requests in flight per replica of the role)
    prefill   prefill replicas      requests waiting for or in prefill: on prefill replicas, or
                                    accepted by a front door and on no replica yet
    decode    decode replicas       streams decoding on decode replicas

    the role acted on: the first rule in BELOW_MIN, ABOVE_MAX, QUEUE_DEPTH, IDLE that a role
    takes; two roles on it: the stronger signal (further below min / above max, deeper queue,
    idle longer); prefill on a tie. No role acts: AT_MAX (deep queues at a role's max) before
    STEADY.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from cluster.config import AutoscalerConfig
from cluster.pd_config import MIXED, ROLES


class ScaleAction(str, Enum):
    NONE = "none"
    UP = "up"
    DOWN = "down"


class ScaleReason(str, Enum):
    BELOW_MIN = "below_min"  # UP: a replica died or was purged
    QUEUE_DEPTH = "queue_depth"  # UP
    ABOVE_MAX = "above_max"  # DOWN
    IDLE = "idle"  # DOWN
    STEADY = "steady"  # NONE: no rule applies
    AT_MAX = "at_max"  # NONE: deep queues, but max_replicas already
    ACTION_IN_FLIGHT = "action_in_flight"  # NONE: another step is still adding or removing one


@dataclass(frozen=True)
class ScaleEvent:
    """One step's decision and, for UP/DOWN, what was done."""

    action: ScaleAction
    reason: ScaleReason
    replica_id: str | None = None  # the replica added or removed
    num_replicas: int = 0  # seen before acting (with pd: of `role`)
    depth: float = 0.0  # requests in flight per replica (with pd: of `role`), seen before acting
    warmed: int = 0  # prefixes transferred onto a new replica
    seconds: float = 0.0  # the action's duration on the injected clock
    role: str = MIXED  # the role scaled (with pd: the role the decision is about)


@dataclass(frozen=True)
class RoleSignal:
    """What one step sees of one role (`cluster.pd`)."""

    role: str
    num_replicas: int  # live replicas of the role, draining ones included
    depth: float  # the role's requests in flight per replica of the role
    idle_for: float | None  # seconds with none of the role's requests in flight (None: some are)
    min_replicas: int  # the role's bounds (`PDConfig.bounds`)
    max_replicas: int


def decide(config: AutoscalerConfig, num_replicas: int, depth: float,
           idle_for: float | None) -> tuple[ScaleAction, ScaleReason]:
    """The policy, pure. `idle_for`: seconds with nothing in flight (None: something is)."""
    return decide_within(config, config.min_replicas, config.max_replicas, num_replicas, depth, idle_for)


def decide_within(config: AutoscalerConfig, lo: int, hi: int, num_replicas: int, depth: float,
                  idle_for: float | None) -> tuple[ScaleAction, ScaleReason]:
    """`decide` between the bounds `lo` and `hi` (a role's; `config`'s thresholds)."""
    c = config
    if num_replicas < lo:
        return ScaleAction.UP, ScaleReason.BELOW_MIN
    if num_replicas > hi:
        return ScaleAction.DOWN, ScaleReason.ABOVE_MAX
    if depth > c.scale_up_queue_depth:
        if num_replicas < hi:
            return ScaleAction.UP, ScaleReason.QUEUE_DEPTH
        return ScaleAction.NONE, ScaleReason.AT_MAX
    if idle_for is not None and idle_for >= c.scale_down_idle_s and num_replicas > lo:
        return ScaleAction.DOWN, ScaleReason.IDLE
    return ScaleAction.NONE, ScaleReason.STEADY


_RANK = {ScaleReason.BELOW_MIN: 0, ScaleReason.ABOVE_MAX: 1, ScaleReason.QUEUE_DEPTH: 2, ScaleReason.IDLE: 3,
         ScaleReason.AT_MAX: 4, ScaleReason.STEADY: 5}


def _strength(s: RoleSignal, reason: ScaleReason) -> float:
    if reason is ScaleReason.BELOW_MIN:
        return s.min_replicas - s.num_replicas
    if reason is ScaleReason.ABOVE_MAX:
        return s.num_replicas - s.max_replicas
    if reason is ScaleReason.IDLE:
        return s.idle_for
    return s.depth


def decide_roles(config: AutoscalerConfig,
                 signals: list[RoleSignal]) -> tuple[RoleSignal, ScaleAction, ScaleReason]:
    """Each role's rule (`decide_within` its own bounds); the one role the step acts on (or, when
    none acts, reports on), ranked as the module doc says. `signals`: one per role."""
    if sorted(s.role for s in signals) != sorted(ROLES):
        raise ValueError(f"one signal per role ({', '.join(ROLES)}), got {[s.role for s in signals]}")
    decided = [(s, *decide_within(config, s.min_replicas, s.max_replicas, s.num_replicas, s.depth, s.idle_for))
               for s in signals]
    return min(decided, key=lambda d: (_RANK[d[2]], -_strength(d[0], d[2]), ROLES.index(d[0].role)))
