"""The autoscaler's rules, unit-tested with an injected clock and a test double for the replicas
(no Ray, no sleeping): the count stays within [min_replicas, max_replicas] (a replica that dies
or is purged is replaced up to min), scale-down only after the idle period, at most one action
per step, and no action while another step's is still in flight."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.config import AutoscalerConfig
from cluster.control.autoscaler import ReplicaAutoscaler, ScaleAction, ScaleReason
from tests.fake_clock import FakeClock

WAIT_S = 30.0  # upper bound on waiting for another thread's event (never reached when it works)


class FakeReplicas:
    """The `ScalableReplicas` double: ids, a settable load, deaths; actions are recorded and can
    be held open (`hold`) to stand for a replica that is still starting or draining."""

    def __init__(self, n: int) -> None:
        self._next = 0
        self.ids: list[str] = []
        self.num_unfinished = 0
        self.calls: list[tuple[str, str]] = []
        self.hold: threading.Event | None = None  # set: actions wait for it
        self.acting = threading.Event()  # set once an action has begun
        self.fail_next_add = False
        for _ in range(n):
            self._new()

    def _new(self) -> str:
        rid = f"replica-{self._next:03d}"
        self._next += 1
        self.ids.append(rid)
        return rid

    @property
    def replica_ids(self) -> list[str]:
        return sorted(self.ids)

    def add_replicas(self, n: int) -> list[str]:
        self.acting.set()
        if self.hold is not None:
            assert self.hold.wait(WAIT_S)
        if self.fail_next_add:
            self.fail_next_add = False
            raise RuntimeError("no resources")
        new = [self._new() for _ in range(n)]
        self.calls += [("add", r) for r in new]
        return new

    def warm(self, replica_id: str, limit: int | None = None) -> int:
        self.calls.append(("warm", replica_id))
        return min(limit or 0, 3)

    def remove_replica(self, replica_id: str) -> None:
        self.acting.set()
        if self.hold is not None:
            assert self.hold.wait(WAIT_S)
        self.ids.remove(replica_id)
        self.calls.append(("remove", replica_id))

    def die(self, replica_id: str | None = None) -> None:
        """A replica dies or is purged (health checks, a front door's report)."""
        self.ids.remove(replica_id or self.replica_ids[0])


def make(n: int, lo: int, hi: int, **kw) -> tuple[ReplicaAutoscaler, FakeReplicas, FakeClock]:
    kw = {"scale_up_queue_depth": 2.0, "scale_down_idle_s": 60.0, **kw}
    replicas, clock = FakeReplicas(n), FakeClock()
    return ReplicaAutoscaler(replicas, AutoscalerConfig(lo, hi, **kw), clock=clock), replicas, clock


# ---- bounds ---------------------------------------------------------------------------------------
def test_deep_queues_add_one_warmed_replica_per_step_up_to_max_and_no_further():
    scaler, replicas, clock = make(1, 1, 3)
    replicas.num_unfinished = 100
    first = scaler.step()
    assert (first.action, first.reason, first.num_replicas) == (ScaleAction.UP, ScaleReason.QUEUE_DEPTH, 1)
    assert first.depth == 100.0 and first.warmed == 3  # warm(new, warm_prefixes=8) copied 3 here
    assert replicas.calls == [("add", first.replica_id), ("warm", first.replica_id)]
    assert scaler.step().action is ScaleAction.UP and len(replicas.ids) == 3
    for _ in range(3):
        clock.advance(3600)
        event = scaler.step()
        assert (event.action, event.reason, event.num_replicas) == (ScaleAction.NONE, ScaleReason.AT_MAX, 3)
    assert len(replicas.ids) == 3 and [e.action for e in scaler.history] == [ScaleAction.UP] * 2


def test_depth_is_per_replica_and_strictly_above_the_threshold():
    scaler, replicas, _ = make(2, 1, 3)
    replicas.num_unfinished = 4  # 2.0 per replica: not above 2.0
    assert scaler.step().reason is ScaleReason.STEADY
    replicas.num_unfinished = 5  # 2.5 per replica
    assert scaler.step().reason is ScaleReason.QUEUE_DEPTH and len(replicas.ids) == 3


@pytest.mark.parametrize("lo, hi", [(2, 3), (2, 2)])
def test_a_dead_replica_is_replaced_up_to_min_without_any_load(lo, hi):
    scaler, replicas, _ = make(lo, lo, hi)
    replicas.die()
    event = scaler.step()
    assert (event.action, event.reason, event.num_replicas) == (ScaleAction.UP, ScaleReason.BELOW_MIN, lo - 1)
    assert len(replicas.ids) == lo
    assert scaler.step().reason is ScaleReason.STEADY and len(replicas.ids) == lo


def test_every_replica_purged_comes_back_one_per_step():
    scaler, replicas, clock = make(3, 3, 4)
    for _ in range(3):
        replicas.die()
    for n in range(3):
        clock.advance(3600)  # idle all along: still no removal below min
        event = scaler.step()
        assert (event.action, event.reason, event.num_replicas, event.depth) == (
            ScaleAction.UP, ScaleReason.BELOW_MIN, n, 0.0)
        assert len(replicas.ids) == n + 1
    assert scaler.step().action is ScaleAction.NONE and len(replicas.ids) == 3


def test_a_death_while_busy_is_replaced_before_deep_queues_are_answered():
    scaler, replicas, _ = make(2, 2, 4)
    replicas.num_unfinished = 100
    replicas.die()
    assert scaler.step().reason is ScaleReason.BELOW_MIN
    assert scaler.step().reason is ScaleReason.QUEUE_DEPTH and len(replicas.ids) == 3


def test_above_max_removes_one_per_step_even_while_busy():
    scaler, replicas, _ = make(4, 1, 2)
    replicas.num_unfinished = 100
    for n in (4, 3):
        event = scaler.step()
        assert (event.action, event.reason, event.num_replicas) == (ScaleAction.DOWN, ScaleReason.ABOVE_MAX, n)
    assert len(replicas.ids) == 2 and scaler.step().reason is ScaleReason.AT_MAX


# ---- the idle period --------------------------------------------------------------------------------
def test_scale_down_only_after_a_full_idle_period_then_another_before_the_next():
    scaler, replicas, clock = make(3, 1, 3, scale_down_idle_s=60.0)
    assert scaler.step().reason is ScaleReason.STEADY  # the idle clock starts here
    clock.advance(59.999)
    assert scaler.step().reason is ScaleReason.STEADY and len(replicas.ids) == 3
    clock.advance(0.001)
    down = scaler.step()
    assert (down.action, down.reason, down.replica_id) == (ScaleAction.DOWN, ScaleReason.IDLE, "replica-002")
    assert len(replicas.ids) == 2
    clock.advance(59.999)  # the removal restarted the idle clock
    assert scaler.step().action is ScaleAction.NONE
    clock.advance(0.001)
    assert scaler.step().reason is ScaleReason.IDLE and len(replicas.ids) == 1
    clock.advance(3600)
    assert scaler.step().reason is ScaleReason.STEADY and len(replicas.ids) == 1  # min


def test_any_request_in_flight_restarts_the_idle_period():
    scaler, replicas, clock = make(2, 1, 2)
    scaler.step()
    clock.advance(59)
    replicas.num_unfinished = 1
    assert scaler.step().reason is ScaleReason.STEADY
    replicas.num_unfinished = 0
    clock.advance(1)
    assert scaler.step().action is ScaleAction.NONE  # idle for 0 s, not 60
    clock.advance(59.9)
    assert scaler.step().action is ScaleAction.NONE
    clock.advance(0.1)
    assert scaler.step().reason is ScaleReason.IDLE


def test_the_idle_period_counts_from_the_end_of_a_slow_drain():
    scaler, replicas, clock = make(3, 1, 3, scale_down_idle_s=10.0)

    def slow_remove(replica_id: str) -> None:
        clock.advance(25)  # draining its last requests took 25 s
        replicas.ids.remove(replica_id)

    replicas.remove_replica = slow_remove
    scaler.step()
    clock.advance(10)
    down = scaler.step()
    assert down.reason is ScaleReason.IDLE and down.seconds == 25
    clock.advance(9.9)
    assert scaler.step().action is ScaleAction.NONE and len(replicas.ids) == 2


# ---- one action per step, none while one is in flight ---------------------------------------------------
def test_no_action_while_another_steps_action_is_in_flight():
    scaler, replicas, _ = make(1, 1, 3)
    replicas.num_unfinished = 100
    replicas.hold = threading.Event()
    results = []
    slow = threading.Thread(target=lambda: results.append(scaler.step()))
    slow.start()
    assert replicas.acting.wait(WAIT_S)  # the first step is starting its replica
    for _ in range(3):
        busy = scaler.step()
        assert (busy.action, busy.reason) == (ScaleAction.NONE, ScaleReason.ACTION_IN_FLIGHT)
    assert replicas.calls == [] and scaler.history == []
    replicas.hold.set()
    slow.join(WAIT_S)
    assert results[0].action is ScaleAction.UP and len(replicas.ids) == 2
    assert [c for c, _ in replicas.calls] == ["add", "warm"]
    assert scaler.step().action is ScaleAction.UP and len(replicas.ids) == 3  # free again


def test_a_failed_action_is_not_recorded_and_does_not_block_the_next_step():
    scaler, replicas, _ = make(2, 2, 3)
    replicas.die()
    replicas.fail_next_add = True
    with pytest.raises(RuntimeError, match="no resources"):
        scaler.step()
    assert scaler.history == []
    assert scaler.step().reason is ScaleReason.BELOW_MIN and len(replicas.ids) == 2


def test_the_loop_replaces_a_dead_replica_even_when_min_equals_max():
    scaler, replicas, _ = make(2, 2, 2, interval_s=0.01)
    added = threading.Event()
    add = replicas.add_replicas

    def add_and_tell(n: int) -> list[str]:
        out = add(n)
        added.set()
        return out

    replicas.add_replicas = add_and_tell
    replicas.die()
    scaler.start()
    try:
        assert added.wait(WAIT_S)
    finally:
        scaler.stop()
    assert len(replicas.ids) == 2 and [e.reason for e in scaler.history] == [ScaleReason.BELOW_MIN]


# ---- any sequence of load, deaths and time ---------------------------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("load"), st.integers(0, 40)),
    st.tuples(st.just("die"), st.integers(0, 3)),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 1.0, 29.0, 30.0, 31.0, 120.0])),
    st.tuples(st.just("step"), st.just(0)),
), max_size=60)


@given(lo=st.integers(1, 3), extra=st.integers(0, 3), start=st.integers(0, 7), ops=OPS)
def test_bounds_idle_period_and_one_action_per_step_under_any_history(lo, extra, start, ops):
    hi = lo + extra
    n0 = max(1, min(start, hi + 2))  # may start above max (a config shrunk under a running cluster)
    scaler, replicas, clock = make(n0, lo, hi, scale_down_idle_s=30.0)
    idle_since = None  # as the spec defines it: first step seeing nothing in flight, or the last removal
    for op, arg in ops + [("step", 0)] * 8:
        if op == "load":
            replicas.num_unfinished = arg
        elif op == "die":
            for _ in range(min(arg, len(replicas.ids))):
                replicas.die()
        elif op == "wait":
            clock.advance(arg)
        else:
            before, inflight, num_events = len(replicas.ids), replicas.num_unfinished, len(scaler.history)
            if inflight:
                idle_since = None
            elif idle_since is None:
                idle_since = clock.now
            event = scaler.step()
            after = len(replicas.ids)
            assert event.num_replicas == before
            assert len(scaler.history) - num_events == (event.action is not ScaleAction.NONE)
            assert after - before == {ScaleAction.UP: 1, ScaleAction.DOWN: -1, ScaleAction.NONE: 0}[event.action]
            if before < lo:
                assert event.reason is ScaleReason.BELOW_MIN
            elif before > hi:
                assert event.reason is ScaleReason.ABOVE_MAX
            else:
                assert lo <= after <= hi
            if event.reason is ScaleReason.QUEUE_DEPTH:
                assert inflight > 2.0 * before
            if event.reason is ScaleReason.IDLE:
                assert inflight == 0 and clock.now - idle_since >= 30.0
                idle_since = clock.now
    assert lo <= len(replicas.ids) <= hi  # eight steps after the last death restore min


def test_config_is_frozen_and_validated_with_clear_messages():
    with pytest.raises(ValueError, match="min_replicas=3, max_replicas=2"):
        AutoscalerConfig(3, 2)
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalerConfig(0, 2)
    for kw in ({"scale_up_queue_depth": 0}, {"interval_s": 0}, {"scale_down_idle_s": -1}, {"warm_prefixes": -1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            AutoscalerConfig(1, 2, **kw)
    config = AutoscalerConfig(1, 2)
    with pytest.raises(AttributeError):
        config.max_replicas = 5
