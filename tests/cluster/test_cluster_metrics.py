"""The cluster metrics the dashboard charts: why each request was routed where it was (reasons
from real router decisions), and the replica counts read from the controller's `stats()`."""

from prometheus_client import generate_latest

from cache_service import EagleMode, EventSink, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.global_index import GlobalIndex
from cache_service.router import Router, RoutingPolicy
from cache_service.simulate import make_tokens
from cluster.http.metrics import ROUTE_REASONS, Metrics, route_reason
from tests.cache_service.helpers import make_layout


def test_route_reason_of_each_kind_of_router_decision():
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.LOSSLESS)
    index = GlobalIndex(2)
    tokens = make_tokens(1000, 4, 50)
    hashes = RequestBlockHashes(16, tokens).hashes
    a = LocalPrefixCache(coord, [100, 50], EventSink("a"))
    a.store_prefix(RequestBlockHashes(16, tokens), 1000, (960,))
    index.apply("a", a.events.drain())
    index.add_replica("b")
    router = Router(index, coord, RoutingPolicy.HYBRID)
    hit = router.route(hashes, 1000, {"a": 0, "b": 0})
    busy = router.route(hashes, 1000, {"a": 5000, "b": 0})
    other = router.route(RequestBlockHashes(16, make_tokens(1000, 9, 50)).hashes, 1000, {"a": 0, "b": 0})
    unknown = router.route(hashes, 1000, {"c": 0})  # a replica the index has never heard of
    rr = Router(index, coord, RoutingPolicy.ROUND_ROBIN).route(hashes, 1000, {"a": 0, "b": 0})
    assert route_reason(hit, hit.replica_id, None) == "prefix_hit" and hit.replica_id == "a"
    assert route_reason(busy, "b", None) == "transfer" and busy.transfer.dst_replica == "b"
    assert route_reason(busy, "a", "a") == "forced"  # the request named its replica
    assert route_reason(other, other.replica_id, None) == "no_hit"
    assert route_reason(unknown, "c", None) == "index_unusable"
    assert route_reason(rr, rr.replica_id, None) == "no_hit"
    assert route_reason(None, "b", None) == "no_decision"
    assert route_reason(None, "b", "a") == "no_decision"  # the named replica was gone: routed by load
    assert set(ROUTE_REASONS) == {"forced", "no_decision", "index_unusable", "transfer", "prefix_hit", "no_hit"}


def test_routing_decisions_are_counted_by_replica_and_by_reason():
    m = Metrics()
    m.record_route("hybrid", "replica-0", "prefix_hit")
    m.record_route("hybrid", "replica-1", "prefix_hit")
    m.record_route("load_only", "replica-1", "no_decision")
    m.record_route("hybrid", "replica-0")  # no reason given: counted by replica only
    text = generate_latest(m.registry).decode()
    assert 'hybridserve_routing_decisions_by_reason_total{policy="hybrid",reason="prefix_hit"} 2.0' in text
    assert 'hybridserve_routing_decisions_by_reason_total{policy="load_only",reason="no_decision"} 1.0' in text
    assert text.count("hybridserve_routing_decisions_by_reason_total{") == 2
    assert 'hybridserve_routing_decisions_total{policy="hybrid",replica="replica-0"} 2.0' in text


def test_replica_counts_are_read_from_the_controller_at_each_scrape():
    stats = {"replica_deaths": 1, "replica_restarts": 1, "num_replicas": 3, "replica_slots": 2}  # controller.stats()
    m = Metrics()
    m.attach_cluster_counters(lambda: stats)
    text = generate_latest(m.registry).decode()
    assert "hybridserve_num_replicas 3.0" in text and "hybridserve_replica_slots 2.0" in text
    assert "# TYPE hybridserve_num_replicas gauge" in text and "hybridserve_replica_deaths_total 1.0" in text
    stats.update(num_replicas=4, replica_slots=None)  # an autoscaled cluster keeps no fixed count
    text = generate_latest(m.registry).decode()
    assert "hybridserve_num_replicas 4.0" in text
    assert "# TYPE hybridserve_replica_slots gauge" in text
    assert not [line for line in text.splitlines() if line.startswith("hybridserve_replica_slots")]


def test_hit_tokens_by_group_are_each_groups_own_hit_from_the_lookup_report():
    """Each group counts its own answer at the lookup, not the reconciled hit; an output without a
    report (a backend that made no lookup) counts nothing."""
    from cache_service.miss_reasons import LookupReport
    from workers.engine.request import RequestOutput

    metrics = Metrics()
    report = LookupReport(num_prompt_tokens=300, hit_tokens=128, per_group_hits=(256, 128, 192),
                          attention_match_tokens=192, shared_prefix_tokens=256, candidates=(192, 128))
    out = RequestOutput("r", (1,), (1,), True, "length", 300, 128, 0.01, 0, 0, None, 172, 0, report)
    metrics.record(out)
    metrics.record(RequestOutput("s", (1,), (1,), True, "length", 300, 0, 0.01, 0, 0))
    value = metrics.registry.get_sample_value
    assert [value("hybridserve_prefix_cache_group_hit_tokens_total", {"group": str(g)}) for g in range(3)] == [
        256, 128, 192]
    assert value("hybridserve_prefix_cache_hit_tokens_total") == 128


def test_each_replicas_engine_gauges_are_read_at_each_scrape_under_its_label():
    """A cluster's /metrics: every replica's engine gauges under its own `replica` label, read at
    each scrape (not at registration: that would ask the replicas before they serve); a key a
    replica does not report reads 0, a replica gone from the read has no sample. Catches: samples
    without the label (two replicas collide), values frozen at the first read, a gone replica kept."""
    stats = {"r0": {"num_host_pages": 5, "num_host_promoted_pages": 2}, "r1": {"num_host_pages": 1}}
    reads = []
    m = Metrics()
    m.attach_replica_engine_stats(lambda: reads.append(1) or stats)
    assert reads == []
    value = m.registry.get_sample_value
    assert value("hybridserve_engine_num_host_pages", {"replica": "r0"}) == 5
    assert value("hybridserve_engine_num_host_pages", {"replica": "r1"}) == 1
    assert value("hybridserve_engine_num_host_promoted_pages", {"replica": "r1"}) == 0
    stats["r0"]["num_host_pages"] = 7
    del stats["r1"]
    assert value("hybridserve_engine_num_host_pages", {"replica": "r0"}) == 7
    assert value("hybridserve_engine_num_host_pages", {"replica": "r1"}) is None
