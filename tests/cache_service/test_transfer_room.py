"""A planned transfer lands only where it evicts nothing (`RouterConfig.transfer_may_evict` False,
the default): the destination's last load report must show empty attention blocks for the hit's
pages it lacks (`LoadReportMsg.num_empty_blocks`). Numbers by hand, as in
`test_mutant_kills_router.py`: full:16 + mamba:64, a 1000-token prompt, default costs; a holds
960 tokens at load 5000 (cost 5040), c holds 320 at load 0 (cost 680), b holds nothing at load 0
(cost 1000). With room everywhere a -> b is planned (cost 40 + 960 x 0.05 = 88)."""

from __future__ import annotations

from cache_service.messages import BlockRecord, EventBatchMsg, LoadReportMsg, RecordKind, RouteRequestMsg, TransferPlan
from cache_service.replica_load import LoadBook
from cache_service.router import RouterConfig
from cache_service.service import CacheService
from cache_service.shards import route_over, shard_of
from tests.cache_service.test_mutant_kills_router import HASHES, N, make_router

LOADS = {"a": 5000, "c": 0, "b": 0}


def _route(room: dict[str, int | None] | None, config: RouterConfig | None = None):
    router = make_router({"a": 960, "c": 320, "b": 0}, config)
    return router.route(HASHES, N, LOADS, room=None if room is None else room.get)


def test_the_destination_must_have_empty_blocks_for_the_pages_it_lacks():
    """b lacks all 960 tokens, c lacks 640 (it holds 320 of them): with exactly that room each
    takes the transfer, one token less and it is passed over. Catches: room compared with the
    whole hit (c would need 960), a strict comparison, or room ignored."""
    assert _route({"b": 960, "c": 0}).transfer == TransferPlan("a", "b", 960)
    assert _route({"b": 959, "c": 640}).transfer == TransferPlan("a", "c", 960)
    no_room = _route({"b": 959, "c": 639})
    assert (no_room.replica_id, no_room.transfer, no_room.expected_hit_tokens) == ("c", None, 320)


def test_a_replica_that_reports_no_room_is_taken_as_roomy_and_the_setting_turns_it_off():
    """A replica that never reported empty blocks (None, an older one) may receive; with
    `transfer_may_evict` room is not read at all."""
    assert _route({"b": None, "c": 0}).transfer == TransferPlan("a", "b", 960)
    assert _route(None).transfer == TransferPlan("a", "b", 960)
    evicting = RouterConfig(transfer_may_evict=True)
    assert _route({"b": 0, "c": 0}, evicting).transfer == TransferPlan("a", "b", 960)


def _batch(replica: str, held: int, empty: int | None, seq: int = 0) -> EventBatchMsg:
    records = [BlockRecord(RecordKind.STORED, h, 0b01) for h in HASHES[:held // 16]]
    if held:
        records.append(BlockRecord(RecordKind.STORED, HASHES[held // 16 - 1], 0b10))
    load = LoadReportMsg(num_queued_tokens=LOADS[replica], num_free_blocks=1000, num_empty_blocks=empty)
    return EventBatchMsg(replica, seq, seq + len(records), tuple(records), load)


def test_the_service_reads_room_from_each_replicas_report_and_shards_decide_the_same():
    """Through the cache service (one shard and three): b reports 59 empty 16-token blocks (944
    tokens < 960) and c 40 (640 = what it lacks), so c receives; b reporting 60 takes it back.
    Catches: the service not passing room, room in blocks instead of tokens, or the free (evictable)
    count read instead of the empty one (1000 blocks: b would win)."""
    def decide(b_empty: int, num_shards: int) -> tuple[str, TransferPlan | None]:
        shards = [CacheService(["full:16", "mamba:64"], "lossless", "fp") for _ in range(num_shards)]
        for replica, held, empty in (("a", 960, None), ("c", 320, 40), ("b", 0, b_empty)):
            shard = shards[shard_of(replica, num_shards)]
            shard.add_replica(replica)
            assert shard.ingest(_batch(replica, held, empty)).accepted
        decision = route_over(shards, RouteRequestMsg(tuple(HASHES), N, dry_run=True))
        return decision.replica_id, decision.transfer

    for num_shards in (1, 3):
        assert decide(59, num_shards) == ("c", TransferPlan("a", "c", 960))
        assert decide(60, num_shards) == ("b", TransferPlan("a", "b", 960))


def test_the_load_book_keeps_the_reported_empty_blocks():
    book = LoadBook()
    assert book.empty_blocks("r") is None
    book.report("r", LoadReportMsg(num_empty_blocks=7))
    book.report("s", LoadReportMsg())
    assert (book.empty_blocks("r"), book.empty_blocks("s")) == (7, None)
    assert book.snapshot()["r"]["empty_blocks"] == 7 and "empty_blocks" not in book.snapshot()["s"]
