"""The autoscaler with `cluster.pd`, unit-tested with an injected clock and a test double for the
replicas (no Ray, no sleeping): each rule per role on the role's own replicas, signal and bounds,
one action per step (BELOW_MIN first, then the stronger signal), a replica added for a role
started as that role (warmed only as a prefill replica), a removal taking a replica of the role
scaled down; and the roles' book (`ReplicaRoles`): assignment, the default rule, the signal."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.config import AutoscalerConfig, PDConfig
from cluster.control.autoscaler import ReplicaAutoscaler, ScaleAction, ScaleReason
from cluster.control.replica_roles import DECODE, MIXED, PREFILL, ReplicaRoles, RoleLoad
from cluster.control.scale_policy import RoleSignal, decide_roles
from tests.fake_clock import FakeClock

WAIT_S = 30.0  # upper bound on waiting for another thread's event (never reached when it works)
ROLES = (PREFILL, DECODE)


class FakeRoleReplicas:
    """The `RoleScalableReplicas` double: ids with roles, a settable load per role, deaths; every
    action recorded (with the role asked for) and can be held open (`hold`)."""

    def __init__(self, num_prefill: int, num_decode: int) -> None:
        self._next = 0
        self.roles: dict[str, str] = {}
        self.load = dict.fromkeys(ROLES, 0)  # requests in flight per role
        self.calls: list[tuple[str, str, str]] = []  # (action, replica, role)
        self.hold: threading.Event | None = None
        self.acting = threading.Event()
        for role, n in ((PREFILL, num_prefill), (DECODE, num_decode)):
            for _ in range(n):
                self._new(role)

    def _new(self, role: str) -> str:
        rid = f"replica-{self._next:03d}"
        self._next += 1
        self.roles[rid] = role
        return rid

    def of(self, role: str) -> list[str]:
        return sorted(r for r, held in self.roles.items() if held == role)

    @property
    def replica_ids(self) -> list[str]:
        return sorted(self.roles)

    @property
    def num_unfinished(self) -> int:
        return sum(self.load.values())

    def role_loads(self) -> dict[str, RoleLoad]:
        return {role: RoleLoad(tuple(self.of(role)), self.load[role]) for role in ROLES}

    def add_replicas(self, n: int, role: str | None = None) -> list[str]:
        assert role in ROLES, f"a replica added with pd must be asked for as a role, got {role!r}"
        self.acting.set()
        if self.hold is not None:
            assert self.hold.wait(WAIT_S)
        new = [self._new(role) for _ in range(n)]
        self.calls += [("add", r, role) for r in new]
        return new

    def warm(self, replica_id: str, limit: int | None = None) -> int:
        self.calls.append(("warm", replica_id, self.roles[replica_id]))
        return min(limit or 0, 3)

    def remove_replica(self, replica_id: str) -> None:
        self.acting.set()
        if self.hold is not None:
            assert self.hold.wait(WAIT_S)
        self.calls.append(("remove", replica_id, self.roles.pop(replica_id)))

    def die(self, role: str) -> str:
        rid = self.of(role)[0]
        del self.roles[rid]
        return rid


def make(prefill: tuple[int, int, int], decode: tuple[int, int, int], **kw):
    """(start, min, max) per role (a start outside the bounds: a config changed under a running
    cluster); depth threshold 2, idle period 60 s."""
    num_prefill, num_decode = (min(max(start, lo), hi) for start, lo, hi in (prefill, decode))
    pd = PDConfig(num_prefill, num_decode, min_prefill=prefill[1], max_prefill=prefill[2], min_decode=decode[1],
                  max_decode=decode[2])
    kw = {"scale_up_queue_depth": 2.0, "scale_down_idle_s": 60.0, **kw}
    config = AutoscalerConfig(pd.min_replicas, pd.max_replicas, **kw, pd=pd)
    replicas, clock = FakeRoleReplicas(prefill[0], decode[0]), FakeClock()
    return ReplicaAutoscaler(replicas, config, clock=clock), replicas, clock


# ---- QUEUE_DEPTH per role -----------------------------------------------------------------------------
def test_deep_prefill_queues_add_one_warmed_prefill_replica_and_leave_decode_alone():
    # catches: the replica added without its role (or as decode), the prefill replica not warmed,
    # the event not naming the role or counting every replica instead of the role's
    scaler, replicas, _ = make((1, 1, 3), (2, 1, 3))
    replicas.load[PREFILL] = 5
    event = scaler.step()
    assert (event.action, event.reason, event.role) == (ScaleAction.UP, ScaleReason.QUEUE_DEPTH, PREFILL)
    assert (event.num_replicas, event.depth, event.warmed) == (1, 5.0, 3)
    assert replicas.calls == [("add", event.replica_id, PREFILL), ("warm", event.replica_id, PREFILL)]
    assert (len(replicas.of(PREFILL)), len(replicas.of(DECODE))) == (2, 2)


def test_deep_decode_streams_add_a_decode_replica_that_is_not_warmed():
    # catches: a decode replica warmed with prefixes it never serves (decoders import each request's
    # pages), or decode's streams counted as prefill's signal
    scaler, replicas, _ = make((1, 1, 3), (1, 1, 3))
    replicas.load[DECODE] = 3
    event = scaler.step()
    assert (event.action, event.reason, event.role, event.warmed) == (
        ScaleAction.UP, ScaleReason.QUEUE_DEPTH, DECODE, 0)
    assert replicas.calls == [("add", event.replica_id, DECODE)]


def test_depth_is_per_replica_of_the_role_not_of_the_cluster():
    # catches: depth over every replica (3 prefill requests over 4 replicas is 0.75: no scale-up),
    # or a role's threshold compared with >= instead of >
    scaler, replicas, _ = make((1, 1, 2), (3, 1, 3))
    replicas.load[PREFILL] = 2  # 2.0 per prefill replica: not above 2.0
    assert scaler.step().reason is ScaleReason.STEADY
    replicas.load[PREFILL] = 3
    event = scaler.step()
    assert (event.reason, event.role, event.depth) == (ScaleReason.QUEUE_DEPTH, PREFILL, 3.0)


def test_each_role_stops_at_its_own_max():
    # catches: the cluster's max (the sum, 5) used for a role: prefill would grow past max_prefill 2
    scaler, replicas, _ = make((2, 1, 2), (1, 1, 3))
    replicas.load[PREFILL] = 100
    for _ in range(3):
        event = scaler.step()
        assert (event.action, event.reason, event.role, event.num_replicas) == (
            ScaleAction.NONE, ScaleReason.AT_MAX, PREFILL, 2)
    replicas.load[DECODE] = 10  # the other role's deep queues still scale it
    event = scaler.step()
    assert (event.action, event.role) == (ScaleAction.UP, DECODE) and len(replicas.of(PREFILL)) == 2


def test_the_stronger_signal_goes_first_then_the_other_one_step_each():
    # catches: more than one action per step, a fixed role order instead of the stronger signal
    scaler, replicas, _ = make((1, 1, 3), (1, 1, 3))
    replicas.load[PREFILL], replicas.load[DECODE] = 3, 9
    first = scaler.step()
    assert (first.role, first.reason) == (DECODE, ScaleReason.QUEUE_DEPTH) and len(replicas.replica_ids) == 3
    second = scaler.step()  # decode now 4.5 per replica, prefill 3.0: decode again
    third = scaler.step()  # decode 3.0, prefill 3.0: a tie goes to prefill
    assert [(e.role, e.depth) for e in (second, third)] == [(DECODE, 4.5), (PREFILL, 3.0)]


# ---- BELOW_MIN / ABOVE_MAX per role ------------------------------------------------------------------
def test_a_dead_decode_replica_is_replaced_by_a_decode_replica_before_any_queue_is_answered():
    # catches: a replacement started as the wrong role (or the role the default rule would pick),
    # QUEUE_DEPTH ranked before BELOW_MIN
    scaler, replicas, _ = make((1, 1, 3), (2, 2, 3))
    replicas.die(DECODE)
    replicas.load[PREFILL] = 100
    event = scaler.step()
    assert (event.action, event.reason, event.role, event.num_replicas) == (
        ScaleAction.UP, ScaleReason.BELOW_MIN, DECODE, 1)
    assert replicas.calls == [("add", event.replica_id, DECODE)]
    assert scaler.step().role == PREFILL  # then the deep queues


def test_both_roles_below_min_the_larger_shortfall_first_then_prefill_on_a_tie():
    # catches: one role starved while both are short, or both started in one step
    scaler, replicas, _ = make((2, 2, 3), (3, 3, 4))
    replicas.die(PREFILL)
    for _ in range(2):
        replicas.die(DECODE)
    roles = [scaler.step().role for _ in range(3)]
    assert roles == [DECODE, PREFILL, DECODE]  # decode 2 short, then 1 each: prefill first
    assert (len(replicas.of(PREFILL)), len(replicas.of(DECODE))) == (2, 3)
    assert scaler.step().action is ScaleAction.NONE


def test_above_max_removes_a_replica_of_that_role_even_while_busy():
    # catches: the victim picked among all replicas (the last id here is a decode replica)
    scaler, replicas, _ = make((3, 1, 2), (1, 1, 2))
    replicas.load = {PREFILL: 100, DECODE: 100}
    event = scaler.step()
    assert (event.action, event.reason, event.role) == (ScaleAction.DOWN, ScaleReason.ABOVE_MAX, PREFILL)
    assert replicas.calls == [("remove", event.replica_id, PREFILL)] and event.replica_id == "replica-002"


# ---- IDLE per role ---------------------------------------------------------------------------------------
def test_an_idle_role_shrinks_while_the_other_is_busy_and_its_clock_restarts_after_each_removal():
    # catches: one idle clock for the cluster (decode would never shrink while prefill works), the
    # victim not of the idle role, the role's idle clock not restarted by its removal
    scaler, replicas, clock = make((2, 1, 2), (3, 1, 3))
    replicas.load[PREFILL] = 2  # busy, not deep
    assert scaler.step().action is ScaleAction.NONE  # decode's idle clock starts
    clock.advance(59.999)
    assert scaler.step().action is ScaleAction.NONE
    clock.advance(0.001)
    down = scaler.step()
    assert (down.action, down.reason, down.role) == (ScaleAction.DOWN, ScaleReason.IDLE, DECODE)
    assert replicas.calls == [("remove", "replica-004", DECODE)]
    clock.advance(59.9)
    assert scaler.step().action is ScaleAction.NONE
    clock.advance(0.1)
    assert scaler.step().role == DECODE and len(replicas.of(DECODE)) == 1
    clock.advance(3600)
    assert scaler.step().action is ScaleAction.NONE and len(replicas.of(DECODE)) == 1  # its min
    assert len(replicas.of(PREFILL)) == 2


def test_a_role_with_requests_in_flight_is_not_idle_whatever_the_other_does():
    # catches: a role's idle clock restarted (or not) by the other role's requests
    scaler, replicas, clock = make((2, 1, 2), (2, 1, 2))
    replicas.load[DECODE] = 1
    scaler.step()
    clock.advance(30)
    replicas.load[DECODE] = 0  # decode's clock starts now; prefill's has run 30 s
    scaler.step()
    clock.advance(30)
    down = scaler.step()
    assert (down.reason, down.role) == (ScaleReason.IDLE, PREFILL)


def test_both_idle_the_longer_idle_role_goes_first():
    # catches: a fixed role order among idle roles instead of the longer idle period
    scaler, replicas, clock = make((2, 1, 2), (2, 1, 2))
    replicas.load[PREFILL] = 1
    scaler.step()  # decode idle from here
    clock.advance(10)
    replicas.load[PREFILL] = 0
    scaler.step()  # prefill idle from here
    clock.advance(60)
    down = scaler.step()
    assert (down.reason, down.role) == (ScaleReason.IDLE, DECODE)


# ---- one action at a time ------------------------------------------------------------------------------
def test_no_action_while_another_steps_action_is_in_flight_with_pd():
    # catches: the per-role step bypassing the lock that serializes actions
    scaler, replicas, _ = make((1, 1, 3), (1, 1, 3))
    replicas.load[PREFILL] = 100
    replicas.hold = threading.Event()
    results = []
    slow = threading.Thread(target=lambda: results.append(scaler.step()))
    slow.start()
    assert replicas.acting.wait(WAIT_S)
    busy = scaler.step()
    assert (busy.action, busy.reason) == (ScaleAction.NONE, ScaleReason.ACTION_IN_FLIGHT)
    replicas.hold.set()
    slow.join(WAIT_S)
    assert results[0].role == PREFILL and len(replicas.replica_ids) == 3


OPS = st.lists(st.one_of(
    st.tuples(st.just("load"), st.sampled_from(ROLES), st.integers(0, 20)),
    st.tuples(st.just("die"), st.sampled_from(ROLES), st.integers(0, 3)),
    st.tuples(st.just("wait"), st.just(PREFILL), st.sampled_from([0.0, 1.0, 30.0, 120.0])),
    st.tuples(st.just("step"), st.just(PREFILL), st.just(0)),
), max_size=50)
BOUNDS = st.tuples(st.integers(1, 2), st.integers(0, 2), st.integers(0, 4))  # (min, max - min, start)


@given(pb=BOUNDS, db=BOUNDS, ops=OPS)
def test_each_role_within_its_bounds_one_action_per_step_roles_right_under_any_history(pb, db, ops):
    # catches: an action on a role other than the event's, two actions in one step, a replica added
    # or removed as the wrong role, a role leaving its bounds, a role below min not restored
    (plo, pextra, pstart), (dlo, dextra, dstart) = pb, db
    phi, dhi = plo + pextra, dlo + dextra
    p0, d0 = max(1, min(pstart, phi + 1)), max(1, min(dstart, dhi + 1))  # may start above max
    pd = PDConfig(plo, dlo, min_prefill=plo, max_prefill=phi, min_decode=dlo, max_decode=dhi)
    replicas, clock = FakeRoleReplicas(p0, d0), FakeClock()
    config = AutoscalerConfig(pd.min_replicas, pd.max_replicas, scale_up_queue_depth=2.0, scale_down_idle_s=30.0,
                              pd=pd)
    scaler = ReplicaAutoscaler(replicas, config, clock=clock)
    bounds = {PREFILL: (plo, phi), DECODE: (dlo, dhi)}
    for op, role, arg in ops + [("step", PREFILL, 0)] * 8:
        if op == "load":
            replicas.load[role] = arg
        elif op == "die":
            for _ in range(min(arg, len(replicas.of(role)))):
                replicas.die(role)
        elif op == "wait":
            clock.advance(arg)
        else:
            before = {r: len(replicas.of(r)) for r in ROLES}
            num_calls = len([c for c in replicas.calls if c[0] != "warm"])
            event = scaler.step()
            after = {r: len(replicas.of(r)) for r in ROLES}
            acted = [c for c in replicas.calls if c[0] != "warm"][num_calls:]
            delta = {ScaleAction.UP: 1, ScaleAction.DOWN: -1, ScaleAction.NONE: 0}[event.action]
            assert after[event.role] - before[event.role] == delta and event.num_replicas == before[event.role]
            other = DECODE if event.role == PREFILL else PREFILL
            assert after[other] == before[other] and len(acted) == abs(delta)
            if acted:
                assert acted[0][2] == event.role and acted[0][1] == event.replica_id
            lo, hi = bounds[event.role]
            if event.reason is ScaleReason.BELOW_MIN:
                assert before[event.role] < lo
            elif event.reason is ScaleReason.ABOVE_MAX:
                assert before[event.role] > hi
            elif any(before[r] < bounds[r][0] for r in ROLES):
                raise AssertionError(f"a role below min was not served first: {before}, {event}")
            elif event.action is not ScaleAction.NONE:
                assert lo <= after[event.role] <= hi
    for r in ROLES:
        assert bounds[r][0] <= len(replicas.of(r)) <= bounds[r][1]  # eight steps restore every role


# ---- the policy, pure -----------------------------------------------------------------------------------
def test_decide_roles_needs_one_signal_per_role():
    # catches: a missing role's signal read as "nothing to do" (its replicas never replaced)
    config = AutoscalerConfig(2, 3, pd=PDConfig(1, 1, max_decode=2))
    with pytest.raises(ValueError, match="one signal per role"):
        decide_roles(config, [RoleSignal(PREFILL, 1, 0.0, None, 1, 1)])


def test_autoscaler_config_refuses_bounds_that_are_not_the_roles_sums():
    # catches: an autoscaler config whose cluster bounds disagree with the roles' (which one wins?)
    with pytest.raises(ValueError, match=r"with pd, min_replicas and max_replicas are the roles' sums \(2 and 3\)"):
        AutoscalerConfig(2, 4, pd=PDConfig(1, 1, max_decode=2))


# ---- the roles' book -----------------------------------------------------------------------------------
def test_assigned_roles_win_and_the_default_rule_fills_counts_then_room():
    # catches: an assignment overwritten by the default rule on first ask, the default rule putting
    # a replica beyond max_decode while prefill has room
    roles = ReplicaRoles(PDConfig(1, 1, max_prefill=2, max_decode=1))
    assert [roles.role_of(r) for r in ("a", "b")] == [PREFILL, DECODE]
    roles.assign("c", DECODE)
    assert roles.role_of("c") == DECODE
    assert roles.role_of("d") == PREFILL  # counts filled, decode has no room: prefill (below its max)
    roles.forget("b")
    assert roles.role_of("e") == DECODE  # below num_decode again: a replacement takes the role back


def test_a_fixed_splits_replacement_takes_the_dead_replicas_role():
    # catches: the default rule changed for fixed counts (the restarter relies on it)
    roles = ReplicaRoles(PDConfig(2, 1))
    assert [roles.role_of(r) for r in "abc"] == [PREFILL, PREFILL, DECODE]
    for dead, want in (("a", PREFILL), ("c", DECODE)):
        roles.forget(dead)
        assert roles.role_of(f"new-{dead}") == want


def test_mixed_replicas_have_no_roles_to_assign_or_add():
    # catches: roles handed out (or a role asked for silently ignored) without cluster.pd
    roles = ReplicaRoles(PDConfig())
    assert roles.role_of("a") == MIXED
    with pytest.raises(ValueError, match="cluster.pd is off"):
        roles.assign("b", PREFILL)
    with pytest.raises(ValueError, match="cluster.pd is off"):
        roles.check_add(PREFILL, ["a"], 1, capped=True)


def test_check_add_refuses_no_such_role_and_a_role_beyond_its_max():
    # catches: a start beyond max_decode (or as a typo'd role) let through before the replica starts
    roles = ReplicaRoles(PDConfig(1, 1, max_decode=2))
    ids = ["a", "b"]
    roles.check_add(DECODE, ids, 1, capped=True)
    with pytest.raises(RuntimeError, match=r"at most 2 decode replicas \(cluster.pd.max_decode\), 1 running"):
        roles.check_add(DECODE, ids, 2, capped=True)
    roles.check_add(DECODE, ids, 2, capped=False)  # no autoscaler: no cap, as for mixed replicas
    with pytest.raises(ValueError, match="no role 'decoder'"):
        roles.check_add("decoder", ids, 1, capped=True)


def test_role_loads_count_each_roles_replicas_and_unrouted_requests_as_prefill():
    # catches: decode's streams counted for prefill, requests on no replica yet left out of the
    # prefill signal (or given to decode), a gone replica's stale report counted, the service being
    # down read as every role idle
    roles = ReplicaRoles(PDConfig(2, 1, max_decode=2))
    ids = ["r0", "r1", "r2"]  # prefill, prefill, decode
    loads = roles.loads(ids, {"r0": 2, "r1": 1, "r2": 4, "gone": 7}, num_door_requests=9)
    assert loads == {PREFILL: RoleLoad(("r0", "r1"), 3 + 2), DECODE: RoleLoad(("r2",), 4)}
    assert roles.loads(ids, {"r0": 2, "r1": 1, "r2": 4}, num_door_requests=5)[PREFILL].num_unfinished == 3
    down = roles.loads(ids, None, num_door_requests=6)
    assert (down[PREFILL].num_unfinished, down[DECODE].num_unfinished) == (6, 6)
