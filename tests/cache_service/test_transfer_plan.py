"""`cache_service.transfer_plan`: what moves before a request is served (exact sources, sizes)."""

from __future__ import annotations

from cache_service.messages import ReplicaEstimate, RouteDecision, TransferPlan
from cache_service.transfer_plan import better_holder, plan_transfer


def make_decision(hits: dict[str, int], chosen: str = "a", transfer: TransferPlan | None = None) -> RouteDecision:
    estimates = tuple(ReplicaEstimate(r, hit, 0.0, hit) for r, hit in hits.items())
    return RouteDecision(chosen, "hybrid", hits.get(chosen, 0), estimates, transfer)


def test_the_services_plan_for_the_target_is_taken_as_is():
    plan = TransferPlan("b", "a", 128)
    assert plan_transfer(make_decision({"a": 0, "b": 512}, transfer=plan), "a") == ("b", "a", 128)


def test_a_plan_for_another_replica_falls_back_to_the_best_holder():
    plan = TransferPlan("b", "c", 128)
    assert plan_transfer(make_decision({"a": 64, "b": 512}, transfer=plan), "a") == ("b", "a", 512)


def test_a_holder_must_hit_strictly_more_than_the_target():
    assert plan_transfer(make_decision({"a": 256, "b": 256}), "a") is None
    assert better_holder(make_decision({"a": 256, "b": 256}), "a") is None
    assert plan_transfer(make_decision({"a": 256, "b": 257}), "a") == ("b", "a", 257)


def test_the_target_itself_is_never_its_own_source():
    assert better_holder(make_decision({"a": 512, "b": 64}), "a") is None
    assert plan_transfer(make_decision({"a": 512}), "a") is None


def test_the_best_holder_is_the_largest_hit_and_a_target_without_estimate_hits_zero():
    holder = better_holder(make_decision({"b": 64, "c": 320, "d": 128}), "a")
    assert holder == ReplicaEstimate("c", 320, 0.0, 320)
    assert better_holder(make_decision({}), "a") is None
    assert plan_transfer(make_decision({"b": 1}), "a") == ("b", "a", 1)



def test_a_holder_listed_before_an_equally_hitting_target_is_no_better():
    decision = make_decision({"b": 256, "a": 256})  # max() finds b first: it must still beat a's own hit
    assert better_holder(decision, "a") is None and plan_transfer(decision, "a") is None
    assert better_holder(make_decision({"b": 256, "a": 128}), "a") == ReplicaEstimate("b", 256, 0.0, 256)
