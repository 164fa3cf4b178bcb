"""What a run leaves on disk: every request as a Parquet row (pyarrow) and a PNG plot (matplotlib)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cluster.loadtest.records import LoadTestResult
from cluster.loadtest.report import WorkloadSummary

SCHEMA = pa.schema([
    ("variant", pa.string()), ("workload", pa.string()), ("source", pa.string()), ("phase", pa.string()),
    ("request_index", pa.int32()), ("group", pa.string()), ("turn", pa.int32()), ("cache_salt", pa.string()),
    ("num_prompt_tokens", pa.int32()), ("max_tokens", pa.int32()), ("status", pa.string()), ("error", pa.string()),
    ("start_s", pa.float64()), ("ttft_s", pa.float64()), ("latency_s", pa.float64()), ("tpot_s", pa.float64()),
    ("completion_tokens", pa.int32()), ("cached_tokens", pa.int32()), ("computed_tokens", pa.int32()),
    ("usage_prompt_tokens", pa.int32()), ("itl_s", pa.list_(pa.float64())),
])


def records_table(results: list[LoadTestResult]) -> pa.Table:
    rows = [
        {"variant": res.variant, "workload": res.workload, "source": r.source, "phase": r.phase,
         "request_index": r.index, "group": r.group, "turn": r.turn, "cache_salt": r.cache_salt,
         "num_prompt_tokens": r.num_prompt_tokens, "max_tokens": r.max_tokens, "status": r.status, "error": r.error,
         "start_s": r.start_s, "ttft_s": r.ttft_s, "latency_s": r.latency_s, "tpot_s": r.tpot_s,
         "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens,
         "computed_tokens": r.computed_tokens,
         "usage_prompt_tokens": r.usage_prompt_tokens, "itl_s": r.itl_s}
        for res in results for r in res.records
    ]
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def write_parquet(results: list[LoadTestResult], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(records_table(results), path)
    return path


def cdf_step(ax, values_ms: list[float], style: str, colour, label: str) -> None:
    """One empirical CDF on `ax` (nothing when there are no values)."""
    xs = sorted(values_ms)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, where="post", color=colour, label=label)


def write_plot(results: list[LoadTestResult], summaries: list[WorkloadSummary], path: str | Path) -> Path:
    """One panel per workload: TTFT empirical CDF, cold dashed vs warm solid, a colour per variant.
    Last panel: prefix-cache hit rate (all requests; warm requests as a tick) per variant and workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    workloads = list(dict.fromkeys(r.workload for r in results))
    variants = list(dict.fromkeys(r.variant for r in results))
    colour = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
    fig, axes = plt.subplots(1, len(workloads) + 1, figsize=(5 * (len(workloads) + 1), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for res in (r for r in results if r.workload == workload):
            for phase, style in (("cold", "--"), ("warm", "-")):
                ttfts = [1000 * r.ttft_s for r in res.records if r.phase == phase and r.ok and r.ttft_s is not None]
                cdf_step(ax, ttfts, style, colour[res.variant], f"{res.variant} {phase}")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{workload}: TTFT cold (dashed) vs warm (solid)", fontsize=9)
        ax.legend(fontsize=6)
    ax_hit = axes[0][-1]
    width = 0.8 / max(len(variants), 1)
    for k, variant in enumerate(variants):
        by_workload = {s.workload: s for s in summaries if s.variant == variant}
        xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(workloads))]
        ss = [by_workload.get(w) for w in workloads]
        ax_hit.bar(xs, [100 * (s.hit_rate or 0.0) if s else 0.0 for s in ss], width, color=colour[variant],
                   label=variant)
        ax_hit.scatter(xs, [100 * (s.warm.hit_rate or 0.0) if s else 0.0 for s in ss], color="k", marker="_",
                       s=120, zorder=3)
    ax_hit.set_xticks(range(len(workloads)), workloads)
    ax_hit.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax_hit.set_ylim(0, 100)
    ax_hit.set_title("hit rate per variant (bar: all requests, tick: warm)", fontsize=9)
    ax_hit.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
