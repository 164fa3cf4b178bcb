"""The hybrid router's junction credit: a replica holding only attention KV past the reconciled hit
is credited part of that match (a junction snapshot forms there), never as much as a real hit."""

import pytest

from cache_service import EagleMode, EventSink, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.global_index import GlobalIndex
from cache_service.router import Router, RouterConfig, RoutingPolicy
from cache_service.simulate import make_tokens
from tests.cache_service.helpers import make_layout


def make_cluster(kv_only_tokens: int, snapshot_at: int | None):
    """Replica `kv` holds attention KV for `kv_only_tokens` and no snapshot; `state` holds KV and a
    snapshot at `snapshot_at` (or nothing)."""
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.LOSSLESS)
    index = GlobalIndex(2)
    hashes = RequestBlockHashes(16, make_tokens(1000, 4, 50))
    kv = LocalPrefixCache(coord, [100, 50], EventSink("kv"))
    state = LocalPrefixCache(coord, [100, 50], EventSink("state"))
    kv.store_prefix(hashes, kv_only_tokens, ())
    if snapshot_at is not None:
        state.store_prefix(hashes, snapshot_at, (snapshot_at,))
    for r in (kv, state):
        index.apply(r.events.replica_id, r.events.drain())
    return coord, index, hashes


@pytest.mark.parametrize(("load_on_kv", "want"), [(0, "kv"), (1, "kv"), (319, "kv"), (321, "state")])
def test_kv_match_is_credited_against_load(load_on_kv, want):
    coord, index, hashes = make_cluster(640, None)  # match 640, hit 0: credit 0.5 * 640 = 320 tokens
    router = Router(index, coord, RoutingPolicy.HYBRID, RouterConfig(junction_credit=0.5))
    decision = router.route(hashes.hashes, 1000, {"kv": load_on_kv, "state": 0})
    assert decision.replica_id == want and decision.expected_hit_tokens == 0
    uncredited = Router(index, coord, RoutingPolicy.HYBRID, RouterConfig(junction_credit=0.0))
    assert uncredited.route(hashes.hashes, 1000, {"kv": 1, "state": 0}).replica_id == "state"


@pytest.mark.parametrize(("kv_only", "want"), [(448, "state"), (500, "state"), (576, "kv"), (896, "kv")])
def test_a_real_hit_beats_a_kv_only_match_shorter_than_hit_over_credit(kv_only, want):
    """`state` hits 256 for real; `kv` matches `kv_only` (aligned down to 64) and hits 0: it wins
    only when 0.5 * match > 256 (the overlap router would take `kv` whenever its match is longer)."""
    coord, index, hashes = make_cluster(kv_only, 256)
    router = Router(index, coord, RoutingPolicy.HYBRID, RouterConfig(junction_credit=0.5))
    decision = router.route(hashes.hashes, 1000, {"kv": 0, "state": 0})
    assert decision.replica_id == want
    assert decision.expected_hit_tokens == (256 if want == "state" else 0)
    overlap = Router(index, coord, RoutingPolicy.ATTENTION_OVERLAP, RouterConfig(junction_credit=0.5))
    assert overlap.route(hashes.hashes, 1000, {"kv": 0, "state": 0}).replica_id == "kv"


@pytest.mark.parametrize("credit", [-0.1, 1.0, 2.0])
def test_the_credit_must_stay_below_a_real_hit(credit):
    with pytest.raises(ValueError, match="junction_credit"):
        RouterConfig(junction_credit=credit)
