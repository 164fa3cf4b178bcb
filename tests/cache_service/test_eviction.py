"""The eviction policy objects (`cache_service/eviction.py`) on their own: parsing, each policy's
order, and `value`'s heap agreeing with a brute-force argmin of its formula at every decision.

Wrong changes these tests catch: a heap keyed on a stale tau (after a rebuild) or on the wrong
sign of recency (the property test compares with the formula); pinned states returned or lost
(the LRU and property tests); Marconi's terms unnormalized or swapped (exact scores below); an
unknown policy accepted silently (parsing)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_service.eviction import (
    EvictionConfig,
    EvictionError,
    LruEviction,
    MarconiEviction,
    RecomputeCost,
    ValueEviction,
    make_eviction,
)
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineConfigError


def key(i: int) -> bytes:
    return i.to_bytes(4, "big")


def test_parsing_and_errors():
    assert isinstance(make_eviction("lru"), LruEviction)
    assert isinstance(make_eviction(" Value "), ValueEviction)
    assert make_eviction("marconi").alpha == 1.0 and make_eviction("marconi:2.5").alpha == 2.5
    assert make_eviction("value").tau_per_mean_reuse == 2.0 and make_eviction("value:1.5").tau_per_mean_reuse == 1.5
    assert EngineConfig(eviction="value:1").eviction == "value:1"
    for bad in ("foo", "value:x", "value:0", "value:-1", "value:inf", "value:nan", "lru:1", "marconi:x",
                "marconi:-1", ""):
        with pytest.raises(EvictionError):
            make_eviction(bad)
    with pytest.raises(EvictionError, match="crossover"):
        EvictionConfig("value", 0)
    with pytest.raises(EvictionError, match="unknown eviction policy 'mru'"):
        EvictionConfig("mru")
    with pytest.raises(EngineConfigError, match="unknown eviction policy"):
        EngineConfig(eviction="mru")
    assert EngineConfig().eviction == "value"
    policy = EvictionConfig("value", 1000).build(page_bytes=4)
    assert (policy.page_bytes, policy.cost.crossover_tokens) == (4, 1000)


def test_recompute_cost_and_gain():
    assert RecomputeCost()(640) == 640
    assert RecomputeCost(1000)(1000) == 1500  # p + p^2 / (2 * crossover)
    v = ValueEviction(page_bytes=4, cost=RecomputeCost(1000))
    assert v.gain(2000, 1000) == (4000 - 1500) / 4


def test_lru_order_pins_and_gone_states():
    lru = LruEviction()
    for i in range(4):
        lru.stored(key(i), 64 * (i + 1), 0)
    lru.used(key(0), True, 64)  # 0 is now the most recent
    lru.used(key(9), True, 64)  # unknown: ignored
    assert lru.victim(lambda k: True) == key(1)
    pinned, gone = {key(1)}, {key(2)}
    assert lru.victim(lambda k: None if k in gone else k not in pinned) == key(3)
    assert key(2) not in lru.known() and key(1) in lru.known()  # gone dropped, pinned kept
    lru.removed(key(3))
    assert list(lru.known()) == [key(1), key(0)]
    assert lru.victim(lambda k: False) is None


def test_marconi_score_is_normalized_recency_plus_alpha_times_efficiency():
    def policy(alpha: float) -> MarconiEviction:
        m = MarconiEviction(alpha=alpha)
        m.stored(key(0), 1024, 0)  # oldest, most efficient
        m.now = 5
        m.stored(key(1), 128, 0)  # middle: recency 0.5, efficiency 0
        m.now = 10
        m.stored(key(2), 512, 0)  # newest: recency 1, efficiency (512 - 128) / 896
        return m

    assert policy(0.0).victim(lambda k: True) == key(0)  # recency only: the oldest
    # alpha 1: scores 0 + 1, 0.5 + 0, 1 + 0.43: the least efficient goes
    assert policy(1.0).victim(lambda k: True) == key(1)
    # alpha 0.4: 0.4, 0.5, 1.17: the oldest again
    assert policy(0.4).victim(lambda k: True) == key(0)
    m = policy(1.0)
    m.used(key(1), True, 128)  # now the most recent: 1 + 0 vs key 0's 0 + 1: a tie, older goes
    assert m.victim(lambda k: True) == key(0)
    assert m.victim(lambda k: k != key(0)) == key(1)  # pinned 0: of 1 (1 + 0) and 2 (1 + 1), 1
    assert m.known()[key(1)].num_reuses == 1


def brute_force_victim(v: ValueEviction, free) -> bytes | None:
    candidates = [k for k in v.known() if free(k)]
    return min(candidates, key=lambda k: (v.worth(k), -v.known()[k].last_use), default=None)


OPS = st.lists(st.tuples(st.sampled_from(["store", "use", "restore", "tick", "evict", "pin"]),
                         st.integers(0, 30), st.integers(1, 40)), min_size=1, max_size=120)


@given(OPS)
def test_value_heap_picks_the_least_worth_at_every_decision(ops):
    v = ValueEviction(page_bytes=3)
    pinned: set[bytes] = set()
    for op, i, size in ops:
        k = key(i)
        if op == "store" and k not in v.known():
            v.stored(k, 64 * size, 64 * (size // 3))
        elif op in ("use", "restore"):
            v.used(k, op == "restore", 64 * size)
        elif op == "tick":
            for _ in range(size):
                v.tick()
        elif op == "pin":
            pinned ^= {k}
        elif op == "evict":
            def free(k, held=frozenset(pinned)):
                return k not in held

            chosen = v.victim(free)
            expected = brute_force_victim(v, free)
            if expected is None:
                assert chosen is None
            else:  # the same worth (ties may pick either of equal worth)
                assert chosen is not None and math.isclose(v.worth(chosen), v.worth(expected), rel_tol=1e-9)
                v.removed(chosen)
        assert len(v._heap) <= 2 * len(v.known()) + 65  # stale entries stay bounded


def test_value_admits_only_what_is_worth_more_than_the_victim():
    v = ValueEviction()
    v.stored(key(0), 256, 0)
    assert not v.admits(256, 0, key(0)) and v.admits(320, 0, key(0))
    assert not v.admits(320, 128, key(0))  # worth 192 over its retained parent
    v.tick()  # one request later the retained state is worth less: an equal one now wins
    assert v.admits(256, 0, key(0))


def test_value_rekeys_its_heap_when_the_reuse_distance_moves_tau():
    v = ValueEviction()  # tau 64 until a reuse is seen
    v.stored(key(0), 100, 0)
    v.now = 20
    v.stored(key(1), 60, 0)
    v.stored(key(2), 1000, 0)
    assert v.victim(lambda k: True) == key(1)  # at tau 64: 100 e^(-20/64) > 60
    v.now = 28
    v.used(key(2), True, 1000)  # reused 8 requests later: tau = 2 x 8
    assert v.tau == 16.0
    assert v.victim(lambda k: True) == key(0)  # at tau 16: 100 e^(-20/16) < 60


def test_value_evicts_grid_states_before_boundary_states_until_they_serve_a_hit():
    v = ValueEviction()
    v.stored(key(0), 4096, 0, periodic=True)  # a deep grid state: worth far more ...
    v.stored(key(1), 64, 0)  # ... than this boundary state, but it goes first
    assert v.victim(lambda k: True) == key(0)
    assert not v.admits(8192, 0, key(1), periodic=True)  # a grid state never displaces a boundary
    assert v.admits(128, 0, key(0))  # a boundary state displaces any grid state
    v.used(key(0), True, 4096)  # it served a hit: now a proven state, ranked by worth
    assert v.victim(lambda k: True) == key(1)


def test_the_planner_names_the_grid_positions_no_boundary_needs():
    from cache_service.coordinator import EagleMode, HybridCoordinator
    from cache_service.retention import CheckpointPlanner, make_retention
    from cache_service.specs import CacheLayout, parse_group_spec

    layout = CacheLayout((parse_group_spec("full:16"), parse_group_spec("mamba:64")))
    dense = CheckpointPlanner(HybridCoordinator(layout, EagleMode.OFF), make_retention("dense", 64))
    assert dense.checkpoints(300, 300) == (64, 128, 192, 256)
    assert dense.periodic(300, 300) == {64, 128, 192}  # 256: the replay and final boundary
    assert dense.periodic(300, 300, junctions=(140,)) == {64, 192}  # 128: a junction's state
    drop = HybridCoordinator(CacheLayout((*layout.groups, parse_group_spec("draft:16"))), EagleMode.DROP,
                             drop_rule="alignment")
    planner = CheckpointPlanner(drop, make_retention("dense", 64))
    assert planner.periodic(300, 300) == {64, 128}  # 192: one unit below the boundary (drop)
    latest = CheckpointPlanner(HybridCoordinator(layout, EagleMode.OFF), make_retention("latest", 64))
    assert latest.periodic(300, 300) == frozenset()


# ---- exact defaults, messages and bookkeeping (mutation testing, 6 Dec) ---------------------------
def test_defaults_one_byte_per_page_and_the_cost_model_passed_through():
    cost = RecomputeCost(100.0)
    for policy in (LruEviction(), MarconiEviction(), ValueEviction(), make_eviction("lru"), make_eviction("value"),
                   make_eviction("marconi"), EvictionConfig().build()):
        assert policy.page_bytes == 1 and policy.cost == RecomputeCost()
    assert MarconiEviction().alpha == 1.0
    for spec in ("lru", "value", "marconi", "marconi:2"):
        assert make_eviction(spec, 3, cost).cost is cost and make_eviction(spec, 3, cost).page_bytes == 3
    assert LruEviction(1, cost).cost is cost and MarconiEviction(1, cost).cost is cost
    assert EvictionConfig(crossover_tokens=0.5).build().cost == RecomputeCost(0.5)


def test_error_messages_word_for_word():
    with pytest.raises(EvictionError, match=r"^marconi alpha must be >= 0, got -1\.0$"):
        MarconiEviction(alpha=-1.0)
    with pytest.raises(EvictionError, match=r"^eviction 'marconi:x': expected marconi:ALPHA with a number$"):
        make_eviction("marconi:x")
    with pytest.raises(EvictionError, match=r"^eviction 'value:x': expected value:T with a number, or value:auto$"):
        make_eviction("value:x")
    with pytest.raises(EvictionError,
                       match=r"^value tau per mean reuse distance must be positive and finite, got 0\.0$"):
        make_eviction("value:0")


@pytest.mark.parametrize("policy", [LruEviction, MarconiEviction, ValueEviction])
def test_removing_a_state_forgets_it_and_an_unknown_key_is_ignored(policy):
    p = policy()
    p.stored(key(1), 64, 0)
    p.removed(key(2))
    p.removed(key(1))
    assert key(1) not in p.known() and p.victim(lambda k: True) is None


def test_marconi_entries_learn_their_position_and_count_each_restore():
    m = MarconiEviction()
    m.stored(key(1), 64, 0)
    m.stored(key(2), 0, 0)  # adopted from a transfer: position unknown
    assert m.known()[key(1)].position == 64 and not m.is_reused(key(1)) and not m.is_reused(key(3))
    m.used(key(2), False, 128)
    assert (m.known()[key(2)].position, m.known()[key(2)].gain) == (128, 128.0)
    m.used(key(1), True, 64)
    assert m.is_reused(key(1))  # one restore is enough
    m.used(key(1), True, 64)
    assert m.known()[key(1)].num_reuses == 2


@pytest.mark.parametrize("alpha, expected", [(0.8, 1), (1.5, 2)])
def test_marconi_normalizes_recency_and_gain_by_their_spans(alpha, expected):
    m = MarconiEviction(alpha=alpha)
    m.now = 1
    m.stored(key(1), 100, 0)  # older, more gain: recency 0, gain 1 (x alpha)
    m.now = 3
    m.stored(key(2), 60, 0)  # newer, less gain: recency 1, gain 0
    assert m.victim(lambda k: True) == key(expected)


def test_value_counts_two_restores_for_one_more_than_a_fresh_state():
    v = ValueEviction()
    v.stored(key(1), 64, 0)
    v.used(key(1), True, 64)  # worth 64 x 2 = 128
    v.stored(key(2), 100, 0)  # worth 100: goes first
    assert v.victim(lambda k: True) == key(2)


def test_value_tau_is_twice_the_mean_reuse_distance():
    v = ValueEviction()
    v.stored(key(1), 64, 0)
    v.now = 4
    v.used(key(1), True, 64)
    assert v.tau == 8.0
    v.now = 6
    v.used(key(1), True, 64)  # distances 4 and 2
    assert v.tau == 6.0


@pytest.mark.parametrize("spec, tau", [("value:1", 3.0), ("value:0.5", 1.5), ("value:4", 12.0)])
def test_value_t_scales_tau_by_t_and_so_the_order(spec, tau):
    """`value:T`: tau = T x the mean reuse distance (here 3 requests), so T decides between an old
    deep state and a fresh shallow one: worth gain x exp(-age / tau)."""
    v = make_eviction(spec)
    v.stored(key(1), 64, 0)
    v.now = 3
    v.used(key(1), True, 64)  # one reuse, distance 3
    assert v.tau == tau
    v.stored(key(2), 4096, 0)  # deep (gain 4096), used at 3
    v.now = 13
    v.stored(key(3), 1024, 0)  # shallow (gain 1024), fresh at 13
    v.removed(key(1))
    # key 2 vs key 3: log 4096 + 3 / tau  vs  log 1024 + 13 / tau: the deep one goes when
    # 10 / tau > log 4, i.e. tau < 7.2
    expect = key(2) if tau < 10 / math.log(4) else key(3)
    assert v.victim(lambda k: True) == expect


@pytest.mark.parametrize("now, keyed", [(40, 64.0), (16, 64.0), (64, 64.0), (80, 160.0), (10, 20.0)])
def test_value_rekeys_the_heap_only_when_tau_leaves_half_to_twice_the_keyed_one(now, keyed):
    v = ValueEviction()  # tau 64 until a reuse is seen
    v.stored(key(1), 64, 0)
    v.now = now
    v.used(key(1), True, 64)  # tau = 2 x now
    assert v._keyed_tau == keyed


def test_value_compacts_its_heap_after_twice_the_states_plus_64_stale_keys():
    v = ValueEviction()
    v.stored(key(1), 64, 0)
    v.stored(key(2), 64, 0)
    v.now = 40
    v.used(key(1), True, 64)  # tau 80: within twice the keyed 64, no re-key (3 heap keys)
    uses = 0
    while v._keyed_tau == 64.0 and uses < 80:  # the compaction re-keys with the current tau
        v.used(key(2), False, 64)
        uses += 1
    assert uses == 66 and v._keyed_tau == 80.0 and len(v._heap) == 2


@pytest.mark.parametrize("compact", [False, True])
def test_value_breaks_ties_by_the_order_states_were_stored(compact):
    v = ValueEviction()
    v.stored(key(2), 64, 0)
    v.stored(key(1), 64, 0)  # the same worth, stored later
    v.stored(key(3), 4096, 0)
    for _ in range(70 if compact else 0):
        v.used(key(3), False, 4096)
    assert v.victim(lambda k: True) == key(2)


def test_value_drops_states_gone_from_the_pool_and_puts_pinned_ones_back():
    v = ValueEviction()
    for i in (1, 2, 3):
        v.stored(key(i), 64 * i, 0)
    assert v.victim(lambda k: None if k == key(1) else k == key(3)) == key(3)  # 1 gone, 2 pinned
    assert key(1) not in v.known() and v.victim(lambda k: True) == key(2)
