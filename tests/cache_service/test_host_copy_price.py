"""A host hit priced by what the replica measured (`messages.HostCopyPrice`): the router's cost of a
replica's host tokens is its own reported price (in recomputed tokens), the configured
`host_cost_per_token` only until it reports one; the price travels in the load report through the
service, its log and a snapshot to a front door's read replica, which decides the same."""

from __future__ import annotations

import pytest

from cache_service import RequestBlockHashes
from cache_service.index_mirror import IndexMirror
from cache_service.messages import (
    BlockRecord,
    EventBatchMsg,
    HostCopyPrice,
    LoadReportMsg,
    RecordKind,
    RouteRequestMsg,
)
from cache_service.router import Router, RouterConfig
from cache_service.service import CacheService
from cache_service.simulate import make_tokens
from tests.cache_service.helpers import dev_host_cold

GROUPS = ["full:16", "mamba:64"]


def test_a_replicas_measured_price_replaces_the_configured_one():
    """`dev` against `host` (no third replica: no transfer competes). Configured 0.02 a token:
    copying the 256 host tokens costs 5.12, so `dev` 6 tokens busier loses to `host`. Measured
    40 + 0.1 a token (65.6): `dev` 60 busier still wins, 70 busier loses. Against the idle
    `cold`: a cheap price copies; one dearer than recomputing (1.5 a token) sends the request to
    `cold` with the pages moved there."""
    index, coord, hashes = dev_host_cold()
    router = Router(index, coord, "hybrid", RouterConfig(host_cost_per_token=0.02))
    assert router.route(hashes.hashes, 300, {"dev": 6, "host": 0}).replica_id == "host"
    measured = {"host": HostCopyPrice(40.0, 0.1, 1e9)}
    assert router.route(hashes.hashes, 300, {"dev": 6, "host": 0}, host_prices=measured).replica_id == "dev"
    assert router.route(hashes.hashes, 300, {"dev": 60, "host": 0}, host_prices=measured).replica_id == "dev"
    picked = router.route(hashes.hashes, 300, {"dev": 70, "host": 0}, host_prices=measured)
    assert picked.replica_id == "host" and picked.transfer is None
    assert {e.replica_id: e.cost for e in picked.estimates}["host"] == pytest.approx(300 - 256 + 65.6)
    dear = {"host": HostCopyPrice(0.0, 1.5, 1e6)}
    both = {"host": 0, "cold": 0}
    cheap = router.route(hashes.hashes, 300, both, host_prices={"host": HostCopyPrice(0, 0.04, 1)})
    assert cheap.replica_id == "host" and cheap.transfer is None  # 44 + 10.24 beats moving (44 + 12.8 at cold)
    # dearer than recomputing: `host` (44 + 384) loses to `cold`, which gets the pages moved (44 + 12.8)
    moved = router.route(hashes.hashes, 300, both, host_prices=dear)
    assert moved.replica_id == "cold" and moved.transfer is not None and moved.transfer.src_replica == "host"
    assert router.route(hashes.hashes, 300, both).replica_id == "host"  # the configured 5.12
    # the price is in recomputed tokens: it scales with prefill_cost_per_token (2: dev at load 100
    # costs 88 + 100, host 88 + 2 x 65.6; unscaled, host's 88 + 65.6 would win)
    doubled = Router(index, coord, "hybrid", RouterConfig(prefill_cost_per_token=2.0))
    assert doubled.route(hashes.hashes, 300, {"dev": 100, "host": 0}, host_prices=measured).replica_id == "dev"
    assert doubled.route(hashes.hashes, 300, {"dev": 140, "host": 0}, host_prices=measured).replica_id == "host"
    # a price for a replica without host tokens changes nothing (its device hit costs no copy)
    assert router.route(hashes.hashes, 300, {"dev": 0, "host": 0},
                        host_prices={"dev": HostCopyPrice(1e6, 1e6, 1.0)}).replica_id == "dev"


def test_the_price_is_counted_once_per_hit_plus_per_token():
    price = HostCopyPrice(30.0, 0.25, 1e9)
    assert price.of(0) == 0.0
    assert price.of(1) == pytest.approx(30.25) and price.of(256) == pytest.approx(94.0)


def _host_batch(hashes: RequestBlockHashes, load: LoadReportMsg, first_seq: int) -> EventBatchMsg:
    records = tuple(BlockRecord(RecordKind.HOST_STORED, k, 0b01) for k in hashes.hashes[:16])
    records += (BlockRecord(RecordKind.HOST_STORED, hashes.prefix_hash(256), 0b10),)
    return EventBatchMsg("host", first_seq, first_seq + len(records), records, load)


def test_the_service_and_a_read_replica_route_on_the_reported_price():
    """`host` pushes its host-tier pages with a load report: without a price it wins at equal load
    (the configured price); the next heartbeat reports a measured price dearer than recomputing:
    the service sends the request to the idle `cold` instead, and so does a front door's read
    replica loaded from the service's snapshot, and one that replayed the heartbeat from the log."""
    hashes = RequestBlockHashes(16, make_tokens(300, 5, 50))
    service = CacheService(GROUPS, "off", "fp")
    service.add_replica("host")
    service.add_replica("cold")
    mirror = IndexMirror("door")
    mirror.load(service.snapshot())
    first = _host_batch(hashes, LoadReportMsg(), 0)
    assert service.ingest(first).accepted
    msg = RouteRequestMsg(tuple(hashes.hashes), 300, dry_run=True)
    assert service.route(msg).replica_id == "host"
    dear = HostCopyPrice(0.0, 1.5, 2e6)
    heartbeat = EventBatchMsg("host", first.end_seq, first.end_seq, (), LoadReportMsg(host_copy=dear))
    assert service.ingest(heartbeat).accepted
    assert service.loads.host_copy("host") == dear and service.loads.host_copy("cold") is None
    assert service.route(msg).replica_id == "cold"
    assert service.loads.snapshot()["host"]["host_copy"]["bytes_per_s"] == 2_000_000
    fresh = IndexMirror("door-2")
    fresh.load(service.snapshot())
    assert fresh.route(msg).replica_id == "cold"
    assert mirror.apply(service.log.since(mirror.cursor))
    assert mirror.route(msg).replica_id == "cold"
