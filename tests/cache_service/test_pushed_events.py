"""Pushed event batches end to end in process: a replica's publisher (the production class, its
service call pointed at an in-process `CacheService`) keeps the index equal to the replica's
cache through lost batches and a restarted service, resyncing in chunks while routing goes on by
load; one record per block for all groups."""

from cache_service import EagleMode, EventSink, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.messages import RouteRequestMsg
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.service import CacheService
from cache_service.simulate import make_tokens, run_request
from tests.cache_service.helpers import make_layout
from workers.event_publisher import CacheSnapshot, EventPublisher

GROUPS = ["full:16", "mamba:64", "draft:16"]


class InProcessPublisher(EventPublisher):
    """The production publisher; only its transport is a direct call (and can lose a batch)."""

    lose_next = False

    def call_service(self, method, msg):
        if method == "ingest" and self.lose_next and msg.records:
            self.lose_next = False
            return self.call_service("ingest", type(msg)(msg.replica_id, msg.end_seq, msg.end_seq, (), msg.load))
        return getattr(self.service, method)(msg)


def make_replica(name="r0", chunk_size=7, sizes=(400, 40, 400), host_pages=()):
    coord = HybridCoordinator(make_layout(*GROUPS), EagleMode.DROP)
    cache = LocalPrefixCache(coord, list(sizes), EventSink(name), host_pages=host_pages)
    planner = CheckpointPlanner(coord, make_retention("latest", 64))

    def snapshot():  # as the replica's (`Replica._snapshot_for_resync`)
        cache.events.take_batch()
        return CacheSnapshot([list(p.cached) for p in cache.pools], cache.events.next_seq,
                             [list(p.host.slots) if p.host is not None else [] for p in cache.pools])

    pub = InProcessPublisher(name, cache.events, snapshot, chunk_size=chunk_size)
    return cache, planner, pub


def index_matches(service, cache, name="r0"):
    state = service.index.replicas[name]
    held = [{k for k, v in h.items() if v >> state.bit & 1} for h in service.index.holders]
    on_host = [{k for k, v in h.items() if v >> state.bit & 1} for h in service.index.host_holders]
    return (not state.stale and held == [set(p.cached) for p in cache.pools]
            and on_host == [set(p.host.slots) if p.host is not None else set() for p in cache.pools])


def test_the_host_tier_reaches_the_index_through_pushes_and_chunked_resyncs():
    """Demotions, promotions and host drops travel as pushed events, and a resync (after a lost
    batch, and into a restarted service) carries the host keys in their own chunks (catches: a
    resync that drops the host chunks or files them as device keys)."""
    cache, planner, pub = make_replica(sizes=(40, 6, 40), host_pages=(30, 4, 30))
    pub.service = CacheService(GROUPS, "drop", "", seed=0)
    pub.service.add_replica("r0")
    prompts = [make_tokens(200 + 40 * (i % 3), i % 4, 50) for i in range(10)]
    for i, tokens in enumerate(prompts):
        run_request(cache, planner, tokens, None, explain=False)
        pub.lose_next = i == 5
        pub.push_once()
        assert index_matches(pub.service, cache), i
    assert pub.num_resyncs == 1 and any(len(p.host) for p in cache.pools)
    assert sum(p.host.num_promoted for p in cache.pools)  # hits came back from the host on the way
    pub.service = CacheService(GROUPS, "drop", "", seed=0)  # restarted: only a resync rebuilds it
    run_request(cache, planner, prompts[0], None, explain=False)
    pub.push_once()
    assert pub.num_resyncs == 2 and index_matches(pub.service, cache)
    assert any(pub.service.index.host_holders)


def test_batches_keep_the_index_equal_through_a_lost_batch_and_a_restarted_service():
    cache, planner, pub = make_replica()
    pub.service = CacheService(GROUPS, "drop", "", seed=0)
    pub.service.add_replica("r0")
    prompts = [make_tokens(300 + 50 * i, i % 2, 50) for i in range(8)]
    for i, tokens in enumerate(prompts):
        run_request(cache, planner, tokens, None, explain=False)
        pub.lose_next = i == 3
        pub.push_once()  # one engine step's events
        assert index_matches(pub.service, cache), i
    assert pub.num_resyncs == 1  # the lost batch was seen as a gap and repaired
    records = pub.service.counters["records"]
    pub.service = CacheService(GROUPS, "drop", "", seed=0)  # restarted: it lost everything
    run_request(cache, planner, prompts[0], None, explain=False)
    pub.push_once()
    assert pub.num_resyncs == 2 and index_matches(pub.service, cache)
    assert records > 0


def test_a_resync_in_progress_routes_the_replica_by_load_only():
    cache, planner, pub = make_replica(chunk_size=5)
    service = pub.service = CacheService(GROUPS, "drop", "", seed=0)
    tokens = make_tokens(640, 3, 50)
    run_request(cache, planner, tokens, None, explain=False)
    pub.push_once()
    hashes = RequestBlockHashes(16, tokens)
    msg = RouteRequestMsg(tuple(hashes.hashes), 640, None, 0, dry_run=True)
    assert service.route(msg).expected_hit_tokens > 0 and not service.route(msg).load_only
    sent = []
    real = service.resync_chunk

    def spy(chunk):  # look at routing between the chunks
        sent.append(service.route(msg))
        return real(chunk)

    service.resync_chunk = spy
    pub.request_resync()
    pub.push_once()
    assert len(sent) > 2  # chunked
    assert all(d.replica_id == "r0" and d.expected_hit_tokens == 0 for d in sent[1:])  # load only meanwhile
    assert sent[-1].load_only
    assert service.route(msg).expected_hit_tokens > 0 and index_matches(service, cache)


def test_one_record_per_block_for_all_groups_on_the_wire():
    cache, planner, pub = make_replica()
    tokens = make_tokens(400, 1, 50)
    run_request(cache, planner, tokens, None, explain=False)
    first, end, records = cache.events.take_batch()
    stored = [r for r in records if r.kind.name == "STORED"]
    assert len({r.block_hash for r in stored}) == len(stored)  # full and draft share each block's record
    assert any(r.group_mask == 0b101 for r in stored) and end - first > len(records)


def test_the_service_predicts_with_the_replicas_drop_rule():
    """Routing must expect the hit the engine will find: a service built with the engines'
    `drop_rule` predicts exactly the replica's own lookup under either rule."""
    for rule in ("lookahead", "alignment"):
        coord = HybridCoordinator(make_layout(*GROUPS), EagleMode.DROP, drop_rule=rule)
        cache = LocalPrefixCache(coord, [400, 40, 400], EventSink("r0"))
        planner = CheckpointPlanner(coord, make_retention("latest", 64))

        def snapshot(cache=cache):
            cache.events.take_batch()
            return CacheSnapshot([list(p.cached) for p in cache.pools], cache.events.next_seq)

        pub = InProcessPublisher("r0", cache.events, snapshot)
        pub.service = CacheService(GROUPS, "drop", "", seed=0, drop_rule=rule)
        tokens = make_tokens(300, 9, 50)  # R = 256; the draft block [256, 272) lies inside 300 tokens
        run_request(cache, planner, tokens, None, explain=False)
        pub.push_once()
        msg = RouteRequestMsg(tuple(RequestBlockHashes(16, tokens).hashes), 300, None, 0, dry_run=True)
        expected = 256 if rule == "lookahead" else 192
        assert cache.lookup(RequestBlockHashes(16, tokens), 300).hit_tokens == expected
        assert pub.service.route(msg).expected_hit_tokens == expected
