"""The router's transfer plan, decided exactly: which holder, which destination, where the cost
comparison tips, and the estimates in the decision. Numbers by hand: layout full:16 + mamba:64
(alignment 64), a 1000-token prompt, default costs (prefill 1 and load 1 per token, transfer
0.05 per token, transfers from 256 tokens). Holding H tokens = full blocks [0, H) and a Mamba
snapshot at H, so the hit there is H and its cost 1000 - H + load. Written to kill mutants
`make mutants` found surviving."""

from __future__ import annotations

import pytest

from cache_service import EagleMode, HybridCoordinator, RequestBlockHashes
from cache_service.global_index import GlobalIndex
from cache_service.messages import BlockRecord, RecordKind, ReplicaEstimate, RouteDecision, TransferPlan
from cache_service.router import NoReplicaError, Router, RouterConfig, RoutingPolicy
from cache_service.simulate import make_tokens
from tests.cache_service.helpers import make_layout

N = 1000
HASHES = RequestBlockHashes(16, make_tokens(N, 4, 50)).hashes


def make_router(holdings: dict[str, int], config: RouterConfig | None = None) -> Router:
    """`holdings`: replica -> tokens it holds (0: an empty replica)."""
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.LOSSLESS)
    index = GlobalIndex(2)
    for replica, held in holdings.items():
        index.add_replica(replica)
        records = [BlockRecord(RecordKind.STORED, h, 0b01) for h in HASHES[:held // 16]]
        if held:
            records.append(BlockRecord(RecordKind.STORED, HASHES[held // 16 - 1], 0b10))
        assert not index.apply_batch(replica, 0, len(records), records).needs_resync
    return Router(index, coord, RoutingPolicy.HYBRID, config)


def est(replica: str, hit: int, cost: float) -> ReplicaEstimate:
    return ReplicaEstimate(replica, hit, cost, hit)  # attention tokens = the held blocks = the hit here


def test_a_busy_holder_moves_its_pages_to_the_least_loaded_empty_replica():
    # a: 960 at load 5000 (cost 5040); c: 320 at load 0 (cost 680, the best); b: empty, load 0
    # (cost 1000). Transfer a -> the least loaded of {c, b}: both 0, "b" first by name; its cost
    # 1000 - 960 + 0 + 960 * 0.05 = 88 < 680. b holds nothing, so it is added to the estimates.
    router = make_router({"a": 960, "c": 320, "b": 0})
    decision = router.route(HASHES, N, {"a": 5000, "c": 0}, candidates={"a", "b", "c"})  # b: no load: 0
    assert decision == RouteDecision(
        "b", "hybrid", 960, (est("a", 960, 5040), est("c", 320, 680), ReplicaEstimate("b", 0, 1000)),
        TransferPlan("a", "b", 960))


def test_the_destination_is_the_least_loaded_not_the_first_by_name():
    # as above, but b carries 10 queued tokens: c (load 0) receives; c is already an estimate
    router = make_router({"a": 960, "c": 320, "b": 0})
    decision = router.route(HASHES, N, {"a": 5000, "c": 0, "b": 10})
    assert decision == RouteDecision("c", "hybrid", 960, (est("a", 960, 5040), est("c", 320, 680)),
                                     TransferPlan("a", "c", 960))


def test_an_added_destination_is_costed_with_its_own_load():
    # c: 320 at load 20 (cost 700, the best); b: empty at load 10 (cost 1010) receives (10 < 20):
    # 40 + 10 + 48 = 98 < 700
    router = make_router({"a": 960, "c": 320, "b": 0})
    decision = router.route(HASHES, N, {"a": 5000, "c": 20, "b": 10})
    assert decision == RouteDecision(
        "b", "hybrid", 960, (est("a", 960, 5040), est("c", 320, 700), ReplicaEstimate("b", 0, 1010)),
        TransferPlan("a", "b", 960))


def test_without_an_empty_replica_a_weaker_holder_receives():
    router = make_router({"a": 960, "c": 320})
    decision = router.route(HASHES, N, {"a": 5000, "c": 0})
    assert decision.transfer == TransferPlan("a", "c", 960) and decision.replica_id == "c"


def test_the_cheaper_of_two_equal_holders_is_the_source():
    # a and d both hold 960; d is less loaded (cost 3040 < 5040), so d is the source
    router = make_router({"a": 960, "d": 960, "b": 0})
    decision = router.route(HASHES, N, {"a": 5000, "d": 3000, "b": 0})
    assert decision.transfer == TransferPlan("d", "b", 960)
    assert decision.estimates == (est("a", 960, 5040), ReplicaEstimate("b", 0, 1000), est("d", 960, 3040))


def test_a_transfer_is_planned_only_when_strictly_cheaper():
    # a: 960 at load La (cost 40 + La); b: empty at load 10 (cost 1010). Transfer cost with 0.5
    # per token: 40 + 10 + 960 * 0.5 = 530. At La = 490 a costs 530 too: no transfer.
    config = RouterConfig(transfer_cost_per_token=0.5)
    router = make_router({"a": 960, "b": 0}, config)
    tie = router.route(HASHES, N, {"a": 490, "b": 10})
    assert (tie.replica_id, tie.transfer) == ("a", None)
    router = make_router({"a": 960, "b": 0}, config)
    cheaper = router.route(HASHES, N, {"a": 481}, candidates={"a", "b"})  # b's load missing: 0, 520 < 521
    assert (cheaper.replica_id, cheaper.transfer) == ("b", TransferPlan("a", "b", 960))


def test_the_minimum_transfer_size_is_inclusive():
    router = make_router({"a": 960, "b": 0}, RouterConfig(min_transfer_tokens=960))
    assert router.route(HASHES, N, {"a": 5000, "b": 0}).transfer == TransferPlan("a", "b", 960)
    router = make_router({"a": 960, "b": 0}, RouterConfig(min_transfer_tokens=961))
    decision = router.route(HASHES, N, {"a": 5000, "b": 0})
    assert (decision.replica_id, decision.transfer, decision.expected_hit_tokens) == ("b", None, 0)


# ---- route(): candidates, policies, estimates ----------------------------------------------------------
def test_candidates_default_to_the_load_keys_else_every_indexed_replica():
    router = make_router({"a": 0, "b": 0})
    router.policy = RoutingPolicy.ROUND_ROBIN
    assert [router.route(HASHES, N).replica_id for _ in range(3)] == ["a", "b", "a"]  # the index's
    assert router.route(HASHES, N, {"b": 0}) == RouteDecision("b", "round_robin", 0, ())  # the load's
    with pytest.raises(NoReplicaError, match="^no routable replica$"):
        router.route(HASHES, N, {})
    router.policy = RoutingPolicy.RANDOM
    assert router.route(HASHES, N, {"b": 0}) == RouteDecision("b", "random", 0, ())


def test_a_hybrid_decision_lists_the_chosen_replica_and_every_holder_exactly():
    # a: 640 with a snapshot (cost 360 + 10); b: attention blocks only (hit 0, attention 320,
    # junction credit 0.5 * 320: cost 1000 - 160 + 7): listed for its attention; c: nothing, load
    # missing (0): cost 1000, not listed. Moving a's pages to c would cost 360 + 0 + 640 * 0.05 =
    # 392 > 370: no transfer
    router = make_router({"a": 640, "c": 0})
    index = router.index
    index.add_replica("b")
    records = [BlockRecord(RecordKind.STORED, h, 0b01) for h in HASHES[:20]]
    index.apply_batch("b", 0, len(records), records)
    decision = router.route(HASHES, N, {"a": 10, "b": 7}, candidates={"a", "b", "c"})
    assert decision == RouteDecision("a", "hybrid", 640, (est("a", 640, 370), ReplicaEstimate("b", 0, 847, 320)))
    assert decision.hit_on("a") == 640 and decision.hit_on("b") == 0 and decision.hit_on("c") == 0
    overlap = Router(index, router.coordinator, RoutingPolicy.ATTENTION_OVERLAP)
    assert overlap.route(HASHES, N, {"a": 100, "b": 7}).policy == "attention_overlap"


def test_holders_are_listed_by_hit_then_attention_then_name_up_to_eight():
    holdings = {f"r{i}": 64 * (i % 4 + 1) for i in range(10)}  # hits 64..256, 10 holders
    router = make_router(holdings)
    decision = router.route(HASHES, N, dict.fromkeys(holdings, 0))
    listed = [(e.replica_id, e.hit_tokens) for e in decision.estimates]
    best = sorted(holdings, key=lambda r: (-holdings[r], r))[:8]
    assert sorted(listed) == sorted((r, holdings[r]) for r in best)  # the 8 best, the chosen among them
    assert decision.replica_id in ("r3", "r7") and decision.expected_hit_tokens == 256


def test_a_forced_replica_is_chosen_if_it_is_a_candidate_and_then_nothing_moves():
    router = make_router({"a": 960, "b": 0})
    forced = router.route(HASHES, N, {"a": 5000, "b": 0}, forced="a")  # the busy holder, no transfer
    assert (forced.replica_id, forced.expected_hit_tokens, forced.transfer) == ("a", 960, None)
    ignored = router.route(HASHES, N, {"a": 5000, "b": 0}, candidates={"a", "b"}, forced="z")
    assert ignored.replica_id == "b" and ignored.transfer == TransferPlan("a", "b", 960)
    cold = make_router({"a": 0, "b": 0}).route(HASHES, N, {"a": 0, "b": 9}, forced="b")
    assert (cold.replica_id, cold.transfer) == ("b", None)


def test_equal_holders_are_chosen_at_random_and_a_lighter_one_wins():
    router = make_router({"a": 640, "b": 640}, None)
    picks = [router.route(HASHES, N, {"a": 0, "b": 0}).replica_id for _ in range(20)]
    assert set(picks) == {"a", "b"}
    assert {router.route(HASHES, N, {"a": 1, "b": 0}).replica_id for _ in range(5)} == {"b"}
    assert {router.route(HASHES, N, {"a": 0}, candidates={"a", "b"}).replica_id for _ in range(20)} == {"a", "b"}


def attention_only(router: Router, replica: str, num_tokens: int) -> None:
    """`replica` holds full blocks over the first `num_tokens` tokens, no Mamba snapshot."""
    router.index.add_replica(replica)
    records = [BlockRecord(RecordKind.STORED, h, 0b01) for h in HASHES[:num_tokens // 16]]
    router.index.apply_batch(replica, 0, len(records), records)


def test_without_a_load_map_every_indexed_replica_counts_as_idle():
    router = make_router({"a": 640, "b": 0})
    decision = router.route(HASHES, N)
    assert (decision.replica_id, decision.expected_hit_tokens) == ("a", 640)


def test_random_is_not_round_robin():
    router = make_router({"a": 0, "b": 0})
    router.policy = RoutingPolicy.RANDOM
    picks = [router.route(HASHES, N).replica_id for _ in range(20)]
    assert set(picks) == {"a", "b"} and picks != ["a", "b"] * 10


@pytest.mark.parametrize(("credit", "credited"), [(0.0, 0), (0.5, 160)])
def test_an_attention_only_holder_pays_the_prefill_less_its_junction_credit(credit, credited):
    # b holds attention blocks over 320 tokens but no snapshot: hit 0, cost 1000 - credit * 320 +
    # its load; c, empty and idle: 1000. Without credit b pays the full prefill
    router = make_router({"c": 0}, RouterConfig(junction_credit=credit))
    attention_only(router, "b", 320)
    assert {router.route(HASHES, N, {"b": credited + 1, "c": 0}).replica_id for _ in range(10)} == {"c"}
    # at equal cost the attention holder wins every time (it can snapshot the junction)
    assert {router.route(HASHES, N, {"b": credited, "c": 0}).replica_id for _ in range(10)} == {"b"}


def test_costs_scale_with_the_configured_prices():
    config = RouterConfig(prefill_cost_per_token=2.0, load_cost_per_queued_token=0.5)
    decision = make_router({"a": 640}, config).route(HASHES, N, {"a": 100})
    assert decision.estimates == (ReplicaEstimate("a", 640, 360 * 2.0 + 100 * 0.5, 640),)


def test_the_eight_listed_holders_are_the_best_hits_then_the_most_attention():
    router = make_router({"z": 64})  # z: a real hit of 64
    for i in range(8):  # r0..r7: attention blocks only, r7 the most
        attention_only(router, f"r{i}", 64 * (i + 2))
    decision = router.route(HASHES, N, dict.fromkeys(["z", *(f"r{i}" for i in range(8))], 10 ** 6))
    listed = {e.replica_id for e in decision.estimates}
    assert "z" in listed and "r0" not in listed and {f"r{i}" for i in range(1, 8)} <= listed


def test_a_mamba_only_layout_breaks_cost_ties_by_load():
    # mamba:16 only, 100 tokens: a holds a snapshot at 64 with 64 queued (cost 36 + 64 = 100);
    # b is empty and idle (cost 100): equal costs, no attention anywhere, the lighter b wins
    coord = HybridCoordinator(make_layout("mamba:16"), EagleMode.OFF)
    index = GlobalIndex(1)
    for r in ("a", "b"):
        index.add_replica(r)
    hashes = HASHES[:6]
    index.apply_batch("a", 0, 1, (BlockRecord(RecordKind.STORED, hashes[3], 0b1),))
    router = Router(index, coord, RoutingPolicy.HYBRID)
    assert {router.route(hashes, 100, {"a": 64, "b": 0}).replica_id for _ in range(10)} == {"b"}
    assert router.route(hashes, 100, {"a": 63, "b": 0}).replica_id == "a"


def test_the_default_seed_is_0_and_a_seed_fixes_the_tie_draws():
    def draws(router: Router) -> list[str]:
        return [router.route(HASHES, N, {"a": 0, "b": 0}).replica_id for _ in range(20)]

    coord = make_router({}).coordinator
    index = make_router({"a": 0, "b": 0}).index
    assert draws(Router(index, coord, "hybrid")) == draws(Router(index, coord, "hybrid", seed=0))
    assert draws(Router(index, coord, "hybrid", seed=0)) != draws(Router(index, coord, "hybrid", seed=1))


def test_a_listed_holder_without_a_load_report_is_costed_at_zero_load():
    router = make_router({"a": 640, "b": 320})
    decision = router.route(HASHES, N, {"a": 0}, candidates={"a", "b"})
    assert decision.estimates == (est("a", 640, 360), est("b", 320, 680))


def test_a_real_hit_keeps_its_full_saving_and_only_the_match_beyond_it_is_credited():
    # a holds attention blocks over 640 tokens and a snapshot at 256: hit 256, match 640; its cost
    # is 1000 - 256 - 0.5 * (640 - 256) + 10 = 562 (not 1000 - 0.5 * 384, nor a credit on 640 + 256);
    # b holds blocks and a snapshot at 640 (hit = match, nothing credited): 1000 - 640 + 0 = 360
    router = make_router({"b": 640})
    router.index.add_replica("a")
    records = [BlockRecord(RecordKind.STORED, h, 0b01) for h in HASHES[:40]]
    records.append(BlockRecord(RecordKind.STORED, HASHES[256 // 16 - 1], 0b10))
    router.index.apply_batch("a", 0, len(records), records)
    decision = router.route(HASHES, N, {"a": 10, "b": 0})
    assert decision.estimates == (ReplicaEstimate("a", 256, 562, 640), est("b", 640, 360))


def test_the_router_section_names_a_known_policy():
    assert [RouterConfig(policy=p.value).policy for p in RoutingPolicy] == [
        "hybrid", "attention_overlap", "round_robin", "random"]
    with pytest.raises(ValueError, match=r"^router\.policy must be one of hybrid, attention_overlap, round_robin, "
                                         r"random, got 'smart'$"):
        RouterConfig(policy="smart")
    with pytest.raises(ValueError, match=r"^router\.junction_credit must be in \[0, 1\), got 1\.0$"):
        RouterConfig(junction_credit=1.0)
