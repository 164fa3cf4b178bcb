"""Where a prefilled request decodes (`cache_service.decode_placement`, through the service's route
with `decode_handoff`): the decoder holding the prompt's KV wins at equal load (fewer pages to move),
Mamba state or not; load outweighs holding in the router's units; a decoder without memory headroom
is passed over while another has room; only the output tokens are booked; a front door's read
replica decides the same."""

from __future__ import annotations

import pytest

from cache_service import RequestBlockHashes
from cache_service.decode_placement import POLICY, place_decoder
from cache_service.index_mirror import IndexMirror
from cache_service.messages import BlockRecord, EventBatchMsg, LoadReportMsg, RecordKind, RouteRequestMsg
from cache_service.router import NoReplicaError, ReplicaHits, RouterConfig
from cache_service.service import CacheService
from cache_service.simulate import make_tokens

GROUPS = ["full:16", "mamba:64"]
N = 300  # prompt tokens
HASHES = RequestBlockHashes(16, make_tokens(N, 5, 50))


def _kv_only(replica: str, num_blocks: int, seq: int = 0, load: LoadReportMsg | None = None) -> EventBatchMsg:
    """`replica` stores the prompt's first `num_blocks` attention blocks and no Mamba state (a
    decoder that decoded it before from a hand-off)."""
    records = tuple(BlockRecord(RecordKind.STORED, k, 0b01) for k in HASHES.hashes[:num_blocks])
    return EventBatchMsg(replica, seq, seq + len(records), records, load or LoadReportMsg(num_free_blocks=100))


def _service(*replicas: str) -> CacheService:
    service = CacheService(GROUPS, "off", "fp")
    for r in replicas:
        service.add_replica(r)
    return service


def _decode(num_output: int = 32, exclude: tuple[str, ...] = (), dry_run: bool = True) -> RouteRequestMsg:
    return RouteRequestMsg(tuple(HASHES.hashes), N, None, num_output, exclude=exclude, dry_run=dry_run,
                           decode_handoff=True)


def test_the_decoder_holding_the_prompts_kv_wins_at_equal_load_without_a_mamba_state():
    """`holder` caches 16 attention blocks (256 tokens) and no Mamba state: its reconciled hit is 0,
    so a prefill route sees nothing there, but a hand-off to it moves 44 tokens' pages, not 300.
    Catches: placement by the reconciled hit (a tie: `cold` wins by id), by load only, or
    ignoring the decode flag (the prefill cost)."""
    service = _service("cold", "holder")
    assert service.ingest(_kv_only("holder", 16)).accepted
    prefill = service.route(RouteRequestMsg(tuple(HASHES.hashes), N, dry_run=True))
    assert prefill.expected_hit_tokens == 0  # no Mamba state: no prefill hit anywhere
    decision = service.route(_decode())
    assert decision.replica_id == "holder" and decision.policy == POLICY
    assert decision.expected_hit_tokens == 256
    costs = {e.replica_id: e.cost for e in decision.estimates}
    assert costs == pytest.approx({"holder": 0.05 * 44})  # transfer_cost_per_token x the 44 tokens it lacks


def test_load_outweighs_holding_in_the_routers_units():
    """Moving the 256 held tokens is worth 0.05 x 256 = 12.8 queued tokens: `holder` 12 busier still
    wins, 13 busier loses to the idle `cold`. Catches: a weight other than the router's own, or a
    placement that never looks at load."""
    for load, want in ((12, "holder"), (13, "cold")):
        service = _service("cold", "holder")
        report = LoadReportMsg(num_queued_tokens=load, num_free_blocks=100)
        assert service.ingest(_kv_only("holder", 16, load=report)).accepted
        assert service.route(_decode()).replica_id == want


def test_a_decoder_without_headroom_is_passed_over_while_another_has_room():
    """`holder` reports 3 free blocks (48 tokens): the 44 tokens it lacks plus 32 outputs do not fit,
    so the idle `cold` (100 free blocks) takes it; with 5 free (80 tokens) `holder` fits and wins.
    When no decoder has room the cheapest is chosen anyway (the import refuses and the prefill
    replica keeps the request). A decoder that never reported counts as having room."""
    def place(holder_free: int, cold_free: int | None) -> str:
        service = _service("cold", "holder")
        assert service.ingest(_kv_only("holder", 16, load=LoadReportMsg(num_free_blocks=holder_free))).accepted
        if cold_free is not None:
            heartbeat = EventBatchMsg("cold", 0, 0, (), LoadReportMsg(num_free_blocks=cold_free))
            assert service.ingest(heartbeat).accepted
        return service.route(_decode()).replica_id

    assert place(3, 100) == "cold"
    assert place(5, 100) == "holder"
    assert place(3, 2) == "holder"  # nobody has room: the cheapest
    assert place(3, None) == "cold"  # `cold` never reported: taken to have room


def test_only_the_output_tokens_are_booked_and_a_read_replica_decides_the_same():
    """The decoder's queue grows by the request's 32 output tokens (its prompt arrives computed),
    not by N - hit + 32 as a prefill route books. Catches: booking the prompt on the decoder (the
    next placement would then avoid it for the wrong reason)."""
    service = _service("cold", "holder")
    assert service.ingest(_kv_only("holder", 16)).accepted
    mirror = IndexMirror("door")
    mirror.load(service.snapshot())
    assert mirror.route(_decode()).replica_id == service.route(_decode()).replica_id == "holder"
    service.route(_decode(dry_run=False))
    assert service.loads.queued_tokens("holder") == 32 and service.loads.queued_tokens("cold") == 0
    # excluded: the holder is not a candidate (a prefill replica, or draining)
    assert service.route(_decode(exclude=("holder",))).replica_id == "cold"


def test_no_candidate_raises():
    with pytest.raises(NoReplicaError):
        place_decoder(RouterConfig(), ReplicaHits({}, {}, False), N, 8, {}, {}, ())
