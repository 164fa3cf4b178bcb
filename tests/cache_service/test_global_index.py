"""The global index mirrors replica pools through events; the router uses the same coordinator."""

import pytest

from cache_service import EagleMode, EventSink, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.global_index import GlobalIndex
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.router import NoReplicaError, Router, RoutingPolicy
from cache_service.simulate import make_tokens, run_request
from tests.cache_service.helpers import make_layout


def make_replica(coord, name, sizes=(200, 200)):
    return LocalPrefixCache(coord, list(sizes), EventSink(name))


def test_index_view_gives_the_same_hit_as_the_local_pools():
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.DROP)
    planner = CheckpointPlanner(coord, make_retention("latest", 64))
    replica = make_replica(coord, "r0", sizes=(60, 12))  # small: forces evictions
    index = GlobalIndex(2)
    prompts = [make_tokens(300 + 37 * i, i % 3, 50) for i in range(12)]
    for tokens in prompts:
        run_request(replica, planner, tokens, None, explain=False)
        assert not index.apply("r0", replica.events.drain()).needs_resync
    for tokens in prompts:
        hashes = RequestBlockHashes(16, tokens)
        local = coord.find_longest_hit(hashes.hashes, len(tokens), replica.lookup_view)
        remote = coord.find_longest_hit(hashes.hashes, len(tokens), index.view("r0"))
        assert local == remote
    assert index.replicas["r0"].num_entries == [p.num_cached_blocks for p in replica.pools]


def test_gap_marks_stale_until_resync_and_purge_forgets():
    coord = HybridCoordinator(make_layout("full:16", "mamba:16"))
    replica = make_replica(coord, "r0")
    index = GlobalIndex(2)
    tokens = make_tokens(200, 1, 50)
    hashes = RequestBlockHashes(16, tokens)
    replica.store_prefix(hashes, 200, (192,))
    events = replica.events.drain()
    assert index.apply("r0", events[:3]).num_applied == 3
    result = index.apply("r0", events[4:])  # event 3 lost
    assert result.needs_resync and index.routable_replicas() == []
    index.resync("r0", [p.cached.keys() for p in replica.pools], replica.events.next_seq)
    assert index.routable_replicas() == ["r0"]
    assert coord.find_longest_hit(hashes.hashes, 200, index.view("r0")).hit_tokens == 192
    assert index.purge("r0") == 13 and index.num_entries == 0


def test_hybrid_routes_to_the_mamba_holder_where_overlap_is_fooled():
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.LOSSLESS)
    index = GlobalIndex(2)
    tokens = make_tokens(1000, 4, 50)
    hashes = RequestBlockHashes(16, tokens)
    a, b = make_replica(coord, "a", (100, 50)), make_replica(coord, "b", (100, 50))
    a.store_prefix(hashes, 900, ())  # attention blocks through 896, no Mamba snapshot
    b.store_prefix(hashes, 512, (512,))  # fewer attention blocks, but a snapshot at 512
    for r in (a, b):
        index.apply(r.events.replica_id, r.events.drain())
    hybrid = Router(index, coord, RoutingPolicy.HYBRID).route(hashes.hashes, 1000, {"a": 0, "b": 0})
    overlap = Router(index, coord, RoutingPolicy.ATTENTION_OVERLAP).route(hashes.hashes, 1000, {"a": 0, "b": 0})
    assert (hybrid.replica_id, hybrid.expected_hit_tokens) == ("b", 512)
    assert (overlap.replica_id, overlap.expected_hit_tokens) == ("a", 896)
    # the overlap router's choice really hits 0 there
    assert coord.find_longest_hit(hashes.hashes, 1000, index.view("a")).hit_tokens == 0
    rr = Router(index, coord, RoutingPolicy.ROUND_ROBIN)
    assert [rr.route(hashes.hashes, 1000).replica_id for _ in range(3)] == ["a", "b", "a"]
    assert Router(index, coord, "random").route(hashes.hashes, 1000).replica_id in ("a", "b")


def test_busy_holder_triggers_a_transfer_plan():
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.LOSSLESS)
    index = GlobalIndex(2)
    tokens = make_tokens(1000, 4, 50)
    hashes = RequestBlockHashes(16, tokens)
    a = make_replica(coord, "a", (100, 50))
    a.store_prefix(hashes, 1000, (960,))
    index.apply("a", a.events.drain())
    index.add_replica("b")
    router = Router(index, coord, RoutingPolicy.HYBRID)
    idle = router.route(hashes.hashes, 1000, {"a": 0, "b": 0})
    assert idle.replica_id == "a" and idle.transfer is None
    busy = router.route(hashes.hashes, 1000, {"a": 5000, "b": 0})
    assert busy.replica_id == "b" and busy.transfer is not None
    assert (busy.transfer.src_replica, busy.transfer.dst_replica, busy.transfer.num_tokens) == ("a", "b", 960)
    index.purge("a")
    index.purge("b")
    with pytest.raises(NoReplicaError):
        router.route(hashes.hashes, 1000)


def test_equal_real_hits_break_ties_toward_the_attention_holder():
    """Nobody has a Mamba state for this prompt, but `b` holds its attention KV: a shared-prefix
    junction is detected (and snapshotted) only where the attention match is, so go there."""
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.LOSSLESS)
    index = GlobalIndex(2)
    tokens = make_tokens(1000, 5, 50)
    hashes = RequestBlockHashes(16, tokens)
    a, b = make_replica(coord, "a", (100, 50)), make_replica(coord, "b", (100, 50))
    b.store_prefix(hashes, 700, ())  # attention only
    for r in (a, b):
        index.apply(r.events.replica_id, r.events.drain())
    decision = Router(index, coord, RoutingPolicy.HYBRID).route(hashes.hashes, 1000, {"a": 0, "b": 0})
    assert decision.replica_id == "b" and decision.expected_hit_tokens == 0
    assert {e.replica_id: e.attention_tokens for e in decision.estimates} == {"b": 640}  # in alignment units


def test_equal_costs_break_by_load_then_at_random():
    """An idle cluster spreads requests (not all to the first replica); a less loaded one wins a tie."""
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.LOSSLESS)
    index = GlobalIndex(2)
    for r in ("a", "b"):
        index.add_replica(r)
    router = Router(index, coord, RoutingPolicy.HYBRID, seed=3)
    hashes = RequestBlockHashes(16, make_tokens(300, 6, 50))
    picks = [router.route(hashes.hashes, 300, {"a": 0, "b": 0}).replica_id for _ in range(20)]
    assert set(picks) == {"a", "b"}
    assert picks != sorted(picks)  # not one replica then the other: a real draw
    # nothing cached anywhere: the load decides (a has 1 queued token less)
    assert {router.route(hashes.hashes, 300, {"a": 0, "b": 1}).replica_id for _ in range(10)} == {"a"}


def test_pushed_batches_pack_one_record_per_block_and_skip_old_ones():
    """A block stored in the full and the draft group travels as one record; a batch already in
    a resync snapshot is skipped, a gap is refused until a chunked resync ends."""
    from cache_service.events import EventSink

    sink = EventSink("r0")
    tokens = make_tokens(64, 1, 50)
    hashes = RequestBlockHashes(16, tokens)
    for g in (0, 2):
        sink.stored(g, tuple(hashes.hashes[:2]))
    sink.removed(0, (hashes.hashes[0],))
    first, end, records = sink.take_batch()
    assert (first, end) == (0, 3)
    assert [(r.kind.name, r.group_mask) for r in records] == [("STORED", 0b101), ("STORED", 0b101), ("REMOVED", 1)]
    index = GlobalIndex(3)
    index.add_replica("r0")
    assert not index.apply_batch("r0", first, end, records).needs_resync
    assert index.replicas["r0"].num_entries == [1, 0, 2]
    assert index.apply_batch("r0", 0, 3, records).num_applied == 0  # old: skipped, not a gap
    assert index.apply_batch("r0", 5, 6, records).needs_resync  # events 3..4 lost
    assert index.routable_replicas() == []
    index.begin_resync("r0", "x")
    assert index.resync_chunk("r0", "x", 0, [hashes.hashes[1]])
    assert not index.resync_chunk("r0", "other", 2, [hashes.hashes[1]])  # a stale resync's chunk
    assert index.end_resync("r0", "x", 6) and index.routable_replicas() == ["r0"]
    assert index.replicas["r0"].num_entries == [1, 0, 0] and index.replicas["r0"].next_seq == 6
