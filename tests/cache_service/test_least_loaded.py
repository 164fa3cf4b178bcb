"""The load book's order (`LoadBook.by_load`) is always every replica sorted by load, and a decision
that finds the least loaded replicas from it equals one that looks at every candidate."""

import random

import pytest

from cache_service import HybridCoordinator
from cache_service.global_index import GlobalIndex
from cache_service.messages import LoadReportMsg
from cache_service.replica_load import LoadBook
from cache_service.router import ReplicaHits, Router
from tests.cache_service.helpers import make_layout


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seed", range(10))
def test_the_order_is_every_replica_sorted_by_load_after_any_change(seed):
    rng = random.Random(seed)
    clock = Clock()
    book = LoadBook(pending_ttl_s=2.0, clock=clock)
    accepted: dict[str, int] = {}
    for _ in range(600):
        r = f"r{rng.randrange(12)}"
        roll = rng.random()
        if roll < 0.35:
            accepted[r] = accepted.get(r, 0) + rng.randint(0, 3)
            book.report(r, LoadReportMsg(rng.randrange(0, 50), 0, 0, accepted[r]))
        elif roll < 0.7:
            book.add_pending(r, rng.randrange(0, 30))
        elif roll < 0.8:
            book.forget(r)
            accepted.pop(r, None)
        elif roll < 0.9:
            book.ensure(r)
        else:
            clock.now += rng.random() * 1.5  # pending entries expire on the next view
        assert book.by_load() == sorted((q, r) for r, q in book.current.items())


@pytest.mark.parametrize("seed", range(30))
def test_a_decision_from_the_order_equals_one_over_every_candidate(seed):
    rng = random.Random(seed)
    layout = make_layout("full:16", "mamba:64")
    router = Router(GlobalIndex(2), HybridCoordinator(layout), "hybrid", seed=0)
    for _ in range(40):
        ids = [f"r{i}" for i in range(rng.randint(1, 20))]
        load = {r: rng.choice([0, 10, 10, 50, rng.randrange(100)]) for r in ids}
        candidates = set(rng.sample(ids, rng.randint(1, len(ids))))
        hitters = rng.sample(sorted(candidates), rng.randint(0, min(4, len(candidates))))
        if hitters and rng.random() < 0.5:  # a hitter is the least loaded: it must not count as idle
            load[hitters[0]] = -1
        hits = ReplicaHits({r: rng.choice([64, 128, 256]) for r in hitters},
                           {r: rng.choice([64, 128, 256, 320]) for r in hitters}, bool(hitters))
        order = sorted((q, r) for r, q in load.items())
        n = rng.choice([200, 400])
        router._rng.seed(seed)
        want = router.decide(hits, n, load, candidates)
        router._rng.seed(seed)
        assert router.decide(hits, n, load, candidates, by_load=order) == want
