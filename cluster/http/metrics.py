"""Prometheus metrics of the front end, on a registry of its own (served at `/metrics`).

The front end records finished requests (`record`), per-token latencies (`observe_itl`) and every
HTTP response (`record_response`). A cluster backend reports its own events through
`record_route` and `record_transfer`; it receives this object via `backend.attach_metrics(m)`,
and may hand over its controller's counts (replica deaths, restarts, replicas serving) through
`attach_cluster_counters`, read at each scrape. `deploy/grafana/hybridserve.json` charts them.

The engine's gauges (`ENGINE_GAUGES`: retained Mamba checkpoints, the host tier's pages) come from
a local engine (`attach_engine_stats`: no labels) or from each replica of a cluster
(`attach_replica_engine_stats`: a `replica` label, one sample per replica), read at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# `hybridserve_routing_decisions_by_reason{reason}`: why a front door sent a request where it did
ROUTE_REASONS = {
    "forced": "the request named its replica",
    "no_decision": "no usable cache-service decision (service down or restarting, or it chose a replica "
                   "this front door cannot route to): the least loaded replica",
    "index_unusable": "the cache service's index vouches for no candidate (stale or unknown replicas): by load",
    "transfer": "the best holder is busy: its pages move to a less loaded replica, which serves a local hit",
    "prefix_hit": "the replica expected to hit the most of the prompt, net of its load",
    "no_hit": "no replica expected to hit (or a round_robin / random policy): the cheapest by load",
}


def route_reason(decision, target: str, forced: str | None) -> str:
    """The `ROUTE_REASONS` key for serving on `target` under a cache-service `RouteDecision`
    (None: the front door routed by load); `forced`: the replica the request named, if any."""
    if forced is not None and target == forced:
        return "forced"
    if decision is None:
        return "no_decision"
    if decision.transfer is not None and decision.transfer.dst_replica == target:
        return "transfer"
    if decision.load_only:
        return "index_unusable"
    return "prefix_hit" if decision.expected_hit_tokens > 0 else "no_hit"


# `hybridserve_engine_<key>`: an engine's `stats()` entries exported as gauges
ENGINE_GAUGES = {"num_retained_checkpoints": "retained Mamba checkpoints",
                 "retained_checkpoint_bytes": "bytes of retained Mamba checkpoints",
                 "max_retained_checkpoint_bytes": "byte budget of retained Mamba checkpoints",
                 "num_checkpoint_evictions": "retained Mamba checkpoints evicted (budget or pool pressure)",
                 "num_snapshots_skipped": "Mamba snapshots not taken (worth less than every retained one, or no room)",
                 "num_host_pages": "pages (KV blocks and Mamba states) held by the host tier",
                 "num_host_demoted_pages": "pages copied to the host tier as the device evicted them",
                 "num_host_promoted_pages": "pages copied back from the host tier for a hit",
                 "num_host_dropped_pages": "pages the host tier evicted to make room"}

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("hybridserve_requests", "finished requests by finish reason "
                                "(stop, length, abort, error, disconnect)", ["status"], registry=r)
        self.responses = Counter("hybridserve_http_responses", "HTTP responses by route and status code",
                                 ["route", "code"], registry=r)
        self.prompt_tokens = Counter("hybridserve_prompt_tokens", "prompt tokens", registry=r)
        self.cache_queries = Counter("hybridserve_prefix_cache_queries", "requests that looked up the prefix cache",
                                     registry=r)
        self.cache_hits = Counter("hybridserve_prefix_cache_hits", "requests with a prefix-cache hit", registry=r)
        self.cache_query_tokens = Counter("hybridserve_prefix_cache_query_tokens", "prompt tokens looked up",
                                          registry=r)
        self.cached_tokens = Counter("hybridserve_prefix_cache_hit_tokens", "prompt tokens served from cache",
                                     registry=r)
        # a sibling of the counter above (as vLLM counts vllm:external_prefix_cache_hits beside
        # vllm:prefix_cache_hits): the part of it whose hit copied pages back from the host tier
        self.host_cached_tokens = Counter("hybridserve_prefix_cache_host_hit_tokens",
                                          "prompt tokens served from cache by hits that promoted pages from the "
                                          "host tier (part of hybridserve_prefix_cache_hit_tokens)", registry=r)
        # vLLM's vllm:prompt_tokens_by_source{source=local_compute|local_cache_hit}: the work a hit saved
        # (a prefix moved here by a transfer is registered, then served as a local hit)
        self.prompt_tokens_by_source = Counter(
            "hybridserve_prompt_tokens_by_source", "prompt tokens by source: local_compute (run through the "
            "model's forward) or local_cache_hit (served from the prefix cache)", ["source"], registry=r)
        self.group_cached_tokens = Counter("hybridserve_prefix_cache_group_hit_tokens",
                                           "each cache group's own hit at the lookup, before the groups are "
                                           "reconciled (group: its index in the layout, as the startup "
                                           "cacheability line lists them)",
                                           ["group"], registry=r)
        self.generated = Counter("hybridserve_generation_tokens", "generated tokens", registry=r)
        self.drafts = Counter("hybridserve_spec_decode_draft_tokens", "draft tokens", ["outcome"], registry=r)
        self.ttft = Histogram("hybridserve_time_to_first_token_seconds", "TTFT", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("hybridserve_inter_token_latency_seconds", "time per output token after the first",
                             registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram("hybridserve_request_latency_seconds", "end-to-end request latency", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.num_unfinished = Gauge("hybridserve_num_unfinished_requests", "requests in the backend", registry=r)
        self.routes = Counter("hybridserve_routing_decisions", "router decisions", ["policy", "replica"],
                              registry=r)
        self.route_reasons = Counter("hybridserve_routing_decisions_by_reason", "router decisions by why the "
                                     "replica was chosen: " + ", ".join(ROUTE_REASONS), ["policy", "reason"],
                                     registry=r)
        self.transfers = Counter("hybridserve_transfers", "cache transfers", ["outcome"], registry=r)
        self.transfer_bytes = Counter("hybridserve_transfer_bytes", "bytes moved by cache transfers", registry=r)
        self.transfer_seconds = Histogram("hybridserve_transfer_seconds", "cache transfer duration", registry=r,
                                          buckets=LATENCY_BUCKETS)
        # vLLM's name: requests preempted (pages given back, recomputed later), summed over finished requests
        self.preemptions = Counter("vllm:num_preemptions", "cumulative number of preemptions", registry=r)
        self.engine_gauges: dict[str, Gauge] = {}

    def record(self, out, latency_s: float | None = None) -> None:
        """A finished `RequestOutput`."""
        self.requests.labels(out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.cache_queries.inc()
        self.cache_query_tokens.inc(out.num_prompt_tokens)
        self.cache_hits.inc(1 if out.num_cached_tokens else 0)
        self.cached_tokens.inc(out.num_cached_tokens)
        self.host_cached_tokens.inc(getattr(out, "num_host_cached_tokens", 0))
        self.prompt_tokens_by_source.labels("local_compute").inc(out.num_computed_prompt_tokens)
        self.prompt_tokens_by_source.labels("local_cache_hit").inc(out.num_cached_tokens)
        report = getattr(out, "cache_report", None)  # the first admission's lookup, when the engine made one
        for group, n in enumerate(report.per_group_hits if report is not None else ()):
            self.group_cached_tokens.labels(str(group)).inc(n)
        self.generated.inc(len(out.token_ids))
        self.preemptions.inc(getattr(out, "num_preemptions", 0))
        self.drafts.labels("accepted").inc(out.num_draft_accepted)
        self.drafts.labels("rejected").inc(out.num_draft_proposed - out.num_draft_accepted)
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
        if latency_s is not None:
            self.e2e.observe(latency_s)

    def record_failure(self, status: str) -> None:
        """A request that ended without a finished output: `error` or `disconnect`."""
        self.requests.labels(status).inc()

    def observe_itl(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` arrived `seconds` after the previous ones (several at once with speculation)."""
        for _ in range(num_tokens):
            self.itl.observe(seconds / num_tokens)

    def record_response(self, route: str, code: int) -> None:
        self.responses.labels(route, str(code)).inc()

    def record_route(self, policy: str, decision: str, reason: str | None = None) -> None:
        """The router sent a request to replica `decision` under `policy`, for `reason` (a
        `ROUTE_REASONS` key, see `route_reason`; None: counted by replica only)."""
        self.routes.labels(policy, str(decision)).inc()
        if reason is not None:
            self.route_reasons.labels(policy, reason).inc()

    def record_transfer(self, ok: bool, seconds: float, num_bytes: int) -> None:
        self.transfers.labels("ok" if ok else "failed").inc()
        self.transfer_seconds.observe(seconds)
        self.transfer_bytes.inc(num_bytes)

    def record_transfer_skipped(self) -> None:
        """A planned move not done: the link measured is slower than recomputing (`page_mover`)."""
        self.transfers.labels("skipped_slow_link").inc()

    def attach_engine_stats(self, stats: Callable[[], dict]) -> None:
        """`ENGINE_GAUGES`, read from a local engine's `stats()` at each scrape."""
        for key, doc in ENGINE_GAUGES.items():
            gauge = self.engine_gauges[key] = Gauge(f"hybridserve_engine_{key}", doc, registry=self.registry)
            gauge.set_function(lambda key=key: stats().get(key, 0))

    def attach_replica_engine_stats(self, read: Callable[[], dict[str, dict]]) -> None:
        """`ENGINE_GAUGES` of a cluster's replicas: `read()` at each scrape, {replica id: its
        engine's stats}; one sample per replica, labelled `replica`."""
        self.registry.register(ReplicaEngineGauges(read))

    def attach_cluster_counters(self, read: Callable[[], dict]) -> None:
        """The cluster controller's `stats()`, `read()` at each scrape: replicas purged as dead or
        unhealthy, replacements started for them, and the replicas serving now."""
        self.registry.register(ClusterCounters(read))


class ClusterCounters:
    """A Prometheus collector over the controller's counts (they live in another actor). Every
    front door exports the same values: aggregate them with max, not sum."""

    NAMES = {"replica_deaths": "replicas purged as dead, unhealthy or silent",
             "replica_restarts": "replacements started for dead replicas (fixed replica count)",
             "handoffs": "requests a prefill replica handed to a decode replica after the first token (cluster.pd)",
             "handoffs_kept": "hand-offs that failed on the way: the prefill replica kept and finished the request",
             "handoff_failures": "hand-offs with no replica left to hold the request: it is served again",
             "handoff_bytes": "bytes of delivered hand-offs that crossed a pair channel (pages, sampler state)",
             "handoff_skipped_bytes": "bytes of delivered hand-offs the decoder's own prefix cache held: not sent"}
    GAUGES = {"num_replicas": "replicas the controller runs (draining ones until they stop)",
              "replica_slots": "replicas the controller keeps, replacing dead ones (a fixed replica count; "
                               "no sample under the autoscaler)"}

    def __init__(self, read: Callable[[], dict]) -> None:
        self.read = read

    def collect(self):
        values = self.read()
        for key, doc in self.NAMES.items():
            yield CounterMetricFamily(f"hybridserve_{key}", doc, value=values.get(key, 0))
        for key, doc in self.GAUGES.items():
            gauge = GaugeMetricFamily(f"hybridserve_{key}", doc)
            if values.get(key) is not None:
                gauge.add_metric([], values[key])
            yield gauge


class ReplicaEngineGauges:
    """A Prometheus collector over each replica's `ENGINE_GAUGES` (they live in the replica
    actors): a replica that did not answer in time shows its last values, a gone one none. Every
    front door exports the same values: aggregate a replica's across doors with max, not sum."""

    def __init__(self, read: Callable[[], dict[str, dict]]) -> None:
        self.read = read

    def describe(self):  # the names, without asking the replicas (at registration)
        return [GaugeMetricFamily(f"hybridserve_engine_{key}", doc, labels=["replica"])
                for key, doc in ENGINE_GAUGES.items()]

    def collect(self):
        values = self.read()
        for key, doc in ENGINE_GAUGES.items():
            gauge = GaugeMetricFamily(f"hybridserve_engine_{key}", doc, labels=["replica"])
            for replica_id in sorted(values):
                gauge.add_metric([replica_id], values[replica_id].get(key, 0))
            yield gauge
