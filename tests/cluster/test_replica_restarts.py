"""The fixed-size cluster's replacements (`ReplicaRestarter`) and who keeps the count
(`ReplicaCountKeeper`), unit-tested with an injected clock and a test double for the replicas
(no Ray, no sleeping): a dead replica's slot is refilled (at once the first time, then with an
exponential backoff per slot, reset after a long healthy run), a failed start counts as a death,
removals on purpose are never replaced, and with an autoscaler one death starts one replica."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.config import AutoscalerConfig, ReplicaRestartConfig
from cluster.control.replica_count import REMOVED, ReplicaCountKeeper
from tests.fake_clock import FakeClock

WAIT_S = 30.0  # upper bound on waiting for another thread (never reached when it works)
CONFIG = ReplicaRestartConfig(backoff_initial_s=1.0, backoff_multiplier=2.0, backoff_max_s=10.0,
                              backoff_reset_s=100.0)


class FakeCluster:
    """The replicas: `start_replica` (the restarter's starter), and `ScalableReplicas` for the
    autoscaler. `fail_starts` makes that many starts raise; `hold` keeps a start open."""

    def __init__(self, n: int, clock: FakeClock) -> None:
        self.clock = clock
        self._next = 0
        self.live: list[str] = []
        self.starts: list[tuple[float, str]] = []  # (when, id) of every replica started after the first n
        self.fail_starts = 0
        self.hold: threading.Event | None = None
        self.starting = threading.Event()
        self.num_unfinished = 0
        self.keeper: ReplicaCountKeeper | None = None
        for _ in range(n):
            self._new()

    def _new(self) -> str:
        rid = f"replica-{self._next}"
        self._next += 1
        self.live.append(rid)
        return rid

    def start_replica(self) -> str:
        self.starting.set()
        if self.hold is not None:
            assert self.hold.wait(WAIT_S)
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError("no resources")
        rid = self._new()
        self.starts.append((self.clock(), rid))
        return rid

    # ScalableReplicas (the autoscaler's view)
    @property
    def replica_ids(self) -> list[str]:
        return sorted(self.live)

    def add_replicas(self, n: int) -> list[str]:
        ids = [self.start_replica() for _ in range(n)]
        self.keeper.started(ids)
        return ids

    def warm(self, replica_id: str, limit: int | None = None) -> int:
        return 0

    def remove_replica(self, replica_id: str) -> None:
        self.keeper.removing(replica_id)
        self.purge(replica_id, REMOVED)

    def purge(self, replica_id: str, reason: str) -> None:
        """What `ReplicaSet.purge` + the controller's `_on_purge` do."""
        self.live.remove(replica_id)
        self.keeper.purged(replica_id, reason)


def make(n: int = 2, config: ReplicaRestartConfig = CONFIG, autoscaler: AutoscalerConfig | None = None):
    clock = FakeClock()
    cluster = FakeCluster(n, clock)
    keeper = cluster.keeper = ReplicaCountKeeper(cluster, cluster.start_replica, autoscaler, config, clock)
    keeper.started(list(cluster.live))
    return keeper, cluster, clock


def step_all(keeper: ReplicaCountKeeper) -> None:
    """One pass of every loop the controller runs for the count."""
    for loop in (keeper.autoscaler, keeper.restarter):
        if loop is not None:
            loop.step()


# ---- replacement and backoff --------------------------------------------------------------------------
def test_a_dead_replica_is_replaced_at_once_by_a_new_one():
    keeper, cluster, _ = make(2)
    restarter = keeper.restarter
    victim, survivor = cluster.replica_ids
    cluster.purge(victim, "died")
    assert len(cluster.live) == 1
    (event,) = restarter.step()
    assert (event.replaced, event.num_failures, event.waited_s, event.error) == (victim, 1, 0.0, None)
    assert event.replica_id not in (victim, survivor) and sorted(cluster.live) == sorted([survivor, event.replica_id])
    assert restarter.num_restarts == keeper.num_restarts == 1 and restarter.num_slots == 2
    assert restarter.step() == [] and len(cluster.live) == 2  # nothing more to do


def test_a_crash_loop_backs_off_exponentially_up_to_the_cap():
    keeper, cluster, clock = make(1)
    restarter = keeper.restarter
    waits = []
    for _ in range(7):
        (rid,) = cluster.live
        cluster.purge(rid, "died")  # dies at once after each start
        t_dead = clock()
        while not restarter.step():  # not a moment before it is due
            assert len(cluster.live) == 0
            clock.advance(0.25)
        waits.append(clock() - t_dead)
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert [e.num_failures for e in restarter.history] == [1, 2, 3, 4, 5, 6, 7]
    assert restarter.num_restarts == 7 and len(cluster.live) == 1


def test_a_replacement_that_ran_long_enough_resets_its_slot_and_slots_back_off_independently():
    keeper, cluster, clock = make(2)
    restarter = keeper.restarter
    a, b = cluster.replica_ids
    cluster.purge(a, "died")
    (first,) = restarter.step()
    cluster.purge(first.replica_id, "died")  # a's slot: second death in a row
    clock.advance(0.5)
    assert restarter.step() == []  # due 1 s after the death
    cluster.purge(b, "died")  # b's slot has its own count: replaced at once
    (other,) = restarter.step()
    assert (other.replaced, other.num_failures) == (b, 1)
    clock.advance(0.5)
    (second,) = restarter.step()
    assert (second.replaced, second.num_failures) == (first.replica_id, 2)
    clock.advance(99.9)  # short of backoff_reset_s: still in a loop
    cluster.purge(second.replica_id, "died")
    assert restarter.vacant() == [(0, clock() + 2.0)]
    clock.advance(2.0)
    (third,) = restarter.step()
    clock.advance(100.0)  # ran backoff_reset_s: healthy, the next death is a first one again
    cluster.purge(third.replica_id, "unhealthy (engine loop died)")
    (fourth,) = restarter.step()
    assert fourth.num_failures == 1 and fourth.waited_s == 0.0 and len(cluster.live) == 2


def test_a_failed_start_counts_as_a_death_and_is_retried_after_the_backoff():
    keeper, cluster, clock = make(2)
    restarter = keeper.restarter
    victim = cluster.replica_ids[0]
    cluster.fail_starts = 2
    cluster.purge(victim, "died")
    (failed,) = restarter.step()
    assert (failed.replica_id, failed.error, failed.num_failures) == (None, "RuntimeError: no resources", 1)
    assert restarter.num_failed_starts == 1 and restarter.num_restarts == 0 and len(cluster.live) == 1
    assert restarter.step() == []
    clock.advance(1.0)
    (again,) = restarter.step()
    assert again.replica_id is None and again.num_failures == 2
    clock.advance(1.5)
    assert restarter.step() == []
    clock.advance(0.5)
    (ok,) = restarter.step()
    assert ok.replica_id is not None and ok.num_failures == 3 and ok.replaced == victim
    assert len(cluster.live) == 2 and keeper.num_restarts == 1 and keeper.num_failed_restarts == 2


# ---- what is not replaced ------------------------------------------------------------------------
def test_a_replica_removed_on_purpose_is_not_replaced_even_if_it_dies_while_draining():
    keeper, cluster, clock = make(4)
    restarter = keeper.restarter
    a, b, c, d = cluster.replica_ids
    cluster.remove_replica(a)  # scale-down: drained, then purged as REMOVED
    keeper.removing(b)  # another removal begins; b dies while it drains
    cluster.purge(b, "died")
    cluster.purge(d, REMOVED)  # a purge on purpose with no drain before it
    clock.advance(3600)
    assert restarter.step() == [] and cluster.live == [c] and restarter.num_slots == 1
    cluster.purge(c, "died")  # the one replica left is still kept
    assert [e.replaced for e in restarter.step()] == [c] and len(cluster.live) == 1


def test_replicas_added_on_purpose_are_kept_too_and_unknown_ones_are_ignored():
    keeper, cluster, _ = make(1)
    (added,) = cluster.add_replicas(1)
    assert keeper.restarter.num_slots == 2
    cluster.purge(added, "died")
    assert [e.replaced for e in keeper.restarter.step()] == [added] and len(cluster.live) == 2
    assert keeper.restarter.replica_failed("replica-999", "died") is None  # never had a slot
    assert keeper.restarter.step() == [] and len(cluster.live) == 2


def test_a_replacement_that_dies_before_its_start_returns_is_replaced_again():
    keeper, cluster, _ = make(2)
    restarter = keeper.restarter
    victim = cluster.replica_ids[0]
    start = cluster.start_replica

    def start_and_die() -> str:  # the health loop purges it before the restarter knows its id
        rid = start()
        cluster.purge(rid, "died")
        return rid

    cluster.start_replica = start_and_die
    restarter.start_replica = start_and_die
    cluster.purge(victim, "died")
    (event,) = restarter.step()
    assert event.replica_id not in cluster.live and restarter.vacant() != []  # vacant again, backing off
    cluster.start_replica = restarter.start_replica = start
    restarter.clock.advance(1.0)
    (again,) = restarter.step()
    assert again.replaced == event.replica_id and again.num_failures == 2 and len(cluster.live) == 2


def test_a_replica_added_on_purpose_that_dies_before_it_is_tracked_is_replaced():
    keeper, cluster, _ = make(1)
    rid = cluster.start_replica()  # `add_replicas` started it; the health loop purges it at once
    cluster.purge(rid, "died")
    keeper.started([rid])  # then the controller tracks it
    (event,) = keeper.restarter.step()
    assert event.replaced == rid and len(cluster.live) == 2 and keeper.restarter.num_slots == 2


# ---- the autoscaler owns the count when it is on -------------------------------------------------------
@pytest.mark.parametrize("autoscaler", [None, AutoscalerConfig(2, 2), AutoscalerConfig(2, 3)])
def test_one_death_starts_exactly_one_replica_whoever_keeps_the_count(autoscaler):
    keeper, cluster, clock = make(2, autoscaler=autoscaler)
    assert (keeper.autoscaler is None) != (keeper.restarter is None)  # exactly one keeper
    cluster.purge(cluster.replica_ids[0], "died")
    for _ in range(5):
        step_all(keeper)
        clock.advance(30.0)
    assert len(cluster.live) == 2 and len(cluster.starts) == 1


def test_with_an_autoscaler_a_death_above_min_is_left_to_its_policy():
    keeper, cluster, clock = make(3, autoscaler=AutoscalerConfig(2, 3))
    cluster.purge(cluster.replica_ids[0], "died")
    for _ in range(5):
        step_all(keeper)
        clock.advance(1.0)
    assert len(cluster.live) == 2 and cluster.starts == []  # at min, no load: nothing to add


# ---- concurrency and the loop ------------------------------------------------------------------------------
def test_a_step_while_another_is_starting_a_replacement_starts_nothing():
    keeper, cluster, _ = make(2)
    restarter = keeper.restarter
    cluster.hold = threading.Event()
    cluster.purge(cluster.replica_ids[0], "died")
    results = []
    slow = threading.Thread(target=lambda: results.append(restarter.step()))
    slow.start()
    assert cluster.starting.wait(WAIT_S)
    assert restarter.step() == [] and restarter.vacant() == []  # the slot is being refilled
    cluster.hold.set()
    slow.join(WAIT_S)
    assert len(results[0]) == 1 and len(cluster.live) == 2 and len(cluster.starts) == 1


def test_the_running_loop_replaces_a_death():
    clock = FakeClock()
    cluster = FakeCluster(2, clock)
    started = threading.Event()
    start = cluster.start_replica

    def start_and_tell() -> str:
        rid = start()
        started.set()
        return rid

    cluster.keeper = ReplicaCountKeeper(cluster, start_and_tell, None, CONFIG, clock)
    restarter = cluster.keeper.restarter
    restarter.track(list(cluster.live))
    restarter.start()
    try:
        cluster.purge(cluster.replica_ids[0], "died")
        assert started.wait(WAIT_S)
    finally:
        restarter.stop()
    assert len(cluster.live) == 2 and restarter.num_restarts == 1


# ---- any history ----------------------------------------------------------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("die"), st.integers(0, 5)),
    st.tuples(st.just("remove"), st.integers(0, 5)),
    st.tuples(st.just("add"), st.just(0)),
    st.tuples(st.just("fail_next"), st.just(0)),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.5, 1.0, 3.0, 20.0, 150.0])),
    st.tuples(st.just("step"), st.just(0)),
), max_size=50)


@given(n=st.integers(1, 4), ops=OPS)
def test_the_count_follows_purposeful_changes_only_and_attempts_respect_the_backoff(n, ops):
    keeper, cluster, clock = make(n)
    restarter = keeper.restarter
    wanted = n  # the count the operator asked for: initial + added - removed
    removed: set[str] = set()
    for op, arg in ops:
        ids = cluster.replica_ids
        if op == "die" and ids:
            cluster.purge(ids[arg % len(ids)], "died")
        elif op == "remove" and ids:
            rid = ids[arg % len(ids)]
            cluster.remove_replica(rid)
            removed.add(rid)
            wanted -= 1
        elif op == "add" and not cluster.fail_starts:
            cluster.add_replicas(1)
            wanted += 1
        elif op == "fail_next":
            cluster.fail_starts += 1
        elif op == "wait":
            clock.advance(arg)
        else:
            restarter.step()
        assert len(cluster.live) <= wanted == restarter.num_slots
    for event in restarter.history:
        assert event.replaced not in removed
        assert event.waited_s >= CONFIG.delay_s(event.num_failures) - 1e-9
    cluster.fail_starts = 0
    clock.advance(CONFIG.backoff_max_s)
    restarter.step()
    assert len(cluster.live) == wanted and not set(cluster.live) & removed


# ---- config ----------------------------------------------------------------------------------------------------
def test_delays_and_config_validation():
    assert [CONFIG.delay_s(k) for k in range(1, 8)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert CONFIG.delay_s(10_000) == 10.0  # no overflow
    assert ReplicaRestartConfig(backoff_multiplier=1.0).delay_s(50) == 1.0
    for kw, words in (({"backoff_initial_s": 0}, "backoff_initial_s must be > 0"),
                      ({"backoff_multiplier": 0.5}, "backoff_multiplier must be >= 1"),
                      ({"backoff_max_s": 0.5}, "backoff_max_s must be >= backoff_initial_s"),
                      ({"backoff_reset_s": 0}, "backoff_reset_s must be > 0")):
        with pytest.raises(ValueError, match=words):
            ReplicaRestartConfig(**kw)
    with pytest.raises(AttributeError):
        CONFIG.backoff_max_s = 5.0


def test_yaml_keys_reach_the_restart_config_and_bad_values_name_the_key():
    from cluster.config import ConfigError
    from cluster.config_loader import load_config

    config = load_config(None, ["cluster.restart.backoff_initial_s=2", "cluster.restart.backoff_max_s=30"])
    assert config.cluster.restart == ReplicaRestartConfig(backoff_initial_s=2.0, backoff_max_s=30.0)
    with pytest.raises(ConfigError, match=r"cluster.restart: backoff_max_s must be >= backoff_initial_s"):
        load_config(None, ["cluster.restart.backoff_max_s=0.5"])
    with pytest.raises(ConfigError, match=r"cluster.restart.backoff: unknown key"):
        load_config(None, ["cluster.restart.backoff=1"])
