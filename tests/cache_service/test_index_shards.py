"""An index split into N shards by replica decides as one index: a differential test. The same
random op stream (membership, pushed batches with gaps, chunked and whole resyncs, purges,
booked decisions) goes to one service and, op by op, to the shard owning the op's replica; every
decision over the shards (`shards.route_over`, and read replicas of every shard following their
logs, `ShardedMirror`) equals the single service's, for every EAGLE mode and both drop rules."""

import random

import pytest

from cache_service import EagleMode
from cache_service.index_mirror import ShardedMirror
from cache_service.router import NoReplicaError
from cache_service.service import CacheService
from cache_service.shards import route_over, shard_of
from tests.cache_service.helpers import make_layout
from tests.cache_service.test_index_mirror import Stream, catch_up
from tests.cache_service.test_scorer import GROUP_CHOICES


class Tee:
    """Looks like one service to `Stream`; applies each op to the single service and to its shard."""

    def __init__(self, single: CacheService, shards: list[CacheService]) -> None:
        self.single, self.shards = single, shards
        self.index = single.index

    def _owner(self, replica_id: str) -> CacheService:
        return self.shards[shard_of(replica_id, len(self.shards))]

    def add_replica(self, rid):
        self.single.add_replica(rid)
        self._owner(rid).add_replica(rid)

    def remove_replica(self, rid):
        self.single.remove_replica(rid)
        self._owner(rid).remove_replica(rid)

    def ingest(self, batch):
        reply = self.single.ingest(batch)
        other = self._owner(batch.replica_id).ingest(batch)
        assert (other.accepted, other.next_seq) == (reply.accepted, reply.next_seq)
        return reply

    def resync_chunk(self, chunk):
        reply = self.single.resync_chunk(chunk)
        assert self._owner(chunk.replica_id).resync_chunk(chunk).accepted == reply.accepted
        return reply

    def resync(self, rid, contents, next_seq):
        self.single.resync(rid, contents, next_seq)
        self._owner(rid).resync(rid, contents, next_seq)

    def route(self, msg):
        seed = random.random()
        self.single.router._rng.seed(seed)
        self.shards[0].router._rng.seed(seed)
        try:
            want = self.single.route(msg)
        except NoReplicaError:
            with pytest.raises(NoReplicaError):
                route_over(self.shards, msg)
            return None
        assert route_over(self.shards, msg) == want
        return want


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("rule", ["lookahead", "alignment"])
@pytest.mark.parametrize("seed", range(8))
def test_shards_decide_as_one_index(seed, rule, num_shards):
    rng = random.Random(seed * 7 + num_shards)
    groups = ["full:16"] + rng.sample(GROUP_CHOICES, rng.randint(1, 3))
    layout = make_layout(*groups)
    eagle = list(EagleMode)[seed % len(EagleMode)].value
    single = CacheService(groups, eagle, "fp", seed=1, drop_rule=rule)
    shards = [CacheService(groups, eagle, "fp", seed=1, drop_rule=rule) for _ in range(num_shards)]
    tee = Tee(single, shards)
    stream = Stream(rng, tee, layout)
    mirror = ShardedMirror("door", num_shards)
    decided = 0
    for step in range(400):
        stream.step()
        if step == 40:  # a front door joins: a snapshot of every shard
            for m, shard in zip(mirror.shards, shards):
                m.load(shard.snapshot())
        if rng.random() < 0.1:  # a decision booked: the single service and the owning shard count it
            decided += tee.route(stream.request()) is not None
        if step > 40 and rng.random() < 0.1:
            for m, shard in zip(mirror.shards, shards):
                catch_up(rng, m, shard)
            assert {r: q for s in shards for r, q in s.loads.view().items()} == single.loads.view()
            msg = stream.request(dry_run=True)
            seed_ = rng.random()
            single.router._rng.seed(seed_)
            mirror.shards[0].state.router._rng.seed(seed_)
            try:
                want = single.route(msg)
            except NoReplicaError:
                continue
            assert mirror.route(msg) == want
    assert decided >= 10
    owners = {shard_of(r, num_shards) for r in single.index.replicas}
    assert len(owners) > 1 or len(single.index.replicas) < 2  # the replicas did spread over shards


def test_shard_of_is_stable_and_spreads():
    assert shard_of("anything", 1) == 0
    assert shard_of("replica-7", 4) == shard_of("replica-7", 4)
    counts = [0] * 4
    for i in range(400):
        counts[shard_of(f"hybridserve-replica-{i}", 4)] += 1
    assert min(counts) >= 70
