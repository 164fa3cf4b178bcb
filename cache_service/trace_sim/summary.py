"""The summary of one simulated run: hit tokens, FLOPs saved, modeled TTFT percentiles, state-pool
turnover, load balance.

    flops_saved_share   recompute cost of the hit prefixes over that of every prompt, with the
                        layout's cost(p) (eviction.py): hits on long prefixes count for more
    state_turnover      Mamba snapshots evicted per state page the pools hold: how many times the
                        state pool was replaced over the run
    host tier           host_hit_tokens: tokens of hits that promoted any page from the host tier
                        (part of num_hit_tokens); promoted_bytes: what those promotions copied (the
                        TTFT pays it at host_to_device_bytes_per_s); host_pages_*: the tiers' own
                        counters (demoted, promoted, dropped), summed over distinct caches
    stepped model       (`--decode-model stepped`, `--pd-split`; absent otherwise) itl_s: inter-
                        token latencies over every token of every request; output_tokens_per_s:
                        output tokens over the span from the first arrival to the last token;
                        handoff_bytes: what the hand-offs moved (split)
    value_auto          (`--eviction value:auto` only) the T and admission bias the pools learned
                        (min / median / max) and the evictions and refusals they regretted
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from cache_service.adaptive_value import AdaptiveValueEviction
from cache_service.trace_sim.engine import ClusterSim, RequestRecord
from cache_service.trace_sim.stepped_engine import SteppedClusterSim, SteppedRecord


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summarize(sim: ClusterSim, records: Sequence[RequestRecord], wall_s: float) -> dict:
    s = sim.settings
    ttft = [r.ttft_s for r in records]
    num_input = sum(r.input_tokens for r in records)
    num_hit = sum(r.hit_tokens for r in records)
    per_replica = Counter(r.replica for r in records)
    counts = [per_replica.get(i, 0) for i in range(s.num_replicas)]
    mean = sum(counts) / len(counts)
    distinct = {id(c): c for c in sim.caches}.values()  # the oracle's queues share one cache
    cost = sim.eviction.build().cost
    total_cost = sum(cost(r.input_tokens) for r in records)
    mambas = [m for c in distinct for m in c.cache.groups.of_kind("mamba")]
    state_pages = sum(m.pool.num_blocks - 1 for m in mambas)
    hosts = [p.host for c in distinct for p in c.cache.pools if p.host is not None]
    num_host_hit = sum(r.host_hit_tokens for r in records)
    return {
        "policy": s.policy,
        "layout": s.layout.name,
        "cost_model": s.cost.name,
        "num_replicas": s.num_replicas,
        "retention": s.retention,
        "eviction": s.eviction,
        "eagle": s.eagle,
        "budget_bytes_per_replica": s.budget_bytes,
        "mamba_fraction": s.mamba_fraction,
        "junction_credit": s.router.junction_credit,
        "transfer_may_evict": s.router.transfer_may_evict,
        "num_blocks_per_group": list(sim.num_blocks_per_group),
        "num_requests": len(records),
        "num_input_tokens": num_input,
        "num_hit_tokens": num_hit,
        "hit_rate": num_hit / num_input if num_input else 0.0,
        "flops_saved_share": sum(cost(r.hit_tokens) for r in records) / total_cost if total_cost else 0.0,
        "num_state_evictions": sum(m.num_evictions for m in mambas),
        "state_turnover": sum(m.num_evictions for m in mambas) / state_pages if state_pages else 0.0,
        "num_transfer_tokens": sum(r.transfer_tokens for r in records),
        "host_bytes_per_replica": s.host_bytes,
        "num_host_pages_per_group": list(sim.num_host_pages_per_group),
        "num_host_hit_tokens": num_host_hit,
        "host_hit_rate": num_host_hit / num_input if num_input else 0.0,
        "num_promoted_bytes": sum(r.promoted_bytes for r in records),
        "host_pages_demoted": sum(h.num_demoted for h in hosts),
        "host_pages_promoted": sum(h.num_promoted for h in hosts),
        "host_pages_dropped": sum(h.num_dropped for h in hosts),
        "ttft_s": {
            "mean": sum(ttft) / len(ttft) if ttft else 0.0,
            "p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p95": percentile(ttft, 95),
            "p99": percentile(ttft, 99),
        },
        "requests_per_replica": {
            "max": max(counts), "min": min(counts), "max_over_mean": max(counts) / mean if mean else 0.0,
        },
        "memory_at_end": sim.memory_split(),
        "num_refused_prefills": sum(c.num_refused_prefills for c in distinct),
        "wall_s": wall_s,
        "simulated_requests_per_s": len(records) / wall_s if wall_s > 0 else 0.0,
        **(stepped_summary(sim, records) if isinstance(sim, SteppedClusterSim) else {}),
        **learned_summary([m.eviction for m in mambas]),
    }


def learned_summary(policies: Sequence) -> dict:
    """`value:auto`: what each pool learned (T, the admission bias: min / median / max over pools)
    and how many evictions and refusals it regretted; nothing for the other policies."""
    learned = [p for p in policies if isinstance(p, AdaptiveValueEviction)]
    if not learned:
        return {}

    def spread(values: list[float]) -> dict:
        return {"min": min(values), "median": percentile(values, 50), "max": max(values)}

    return {"value_auto": {"t": spread([p.tau_per_mean_reuse for p in learned]),
                           "bias": spread([p.bias for p in learned]),
                           "num_regrets": sum(p.num_regrets for p in learned)}}


def stepped_summary(sim: SteppedClusterSim, records: Sequence[SteppedRecord]) -> dict:
    """The stepped model's latencies, throughput and hand-offs (the module doc)."""
    itl = sorted(sim.itl_samples)
    split = sim.settings.pd_split
    span = max((r.finish_s for r in records), default=0.0) - min((r.arrival_s for r in records), default=0.0)
    num_output = sum(r.output_tokens for r in records)
    handed = [r for r in records if r.decode_replica >= 0]
    return {
        "decode_model": sim.settings.decode_model,
        "pd_split": str(split) if split is not None else None,
        "num_finished": len(records),
        "num_output_tokens": num_output,
        "itl_s": {
            "mean": sum(itl) / len(itl) if itl else 0.0,
            "p50": percentile(itl, 50), "p90": percentile(itl, 90), "p99": percentile(itl, 99),
            "p99.9": percentile(itl, 99.9), "max": itl[-1] if itl else 0.0,
        },
        "output_tokens_per_s": num_output / span if span > 0 else 0.0,
        "num_handoffs": len(handed),
        "handoff_bytes": sim.num_handoff_bytes,
        "handoff_s_mean": sum(r.handoff_s for r in handed) / len(handed) if handed else 0.0,
        "num_steps": sum(t.num_steps for t in sim.timelines),
    }
