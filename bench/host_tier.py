"""`python -m bench.host_tier`: what a host-memory tier under each replica's pools buys on a trace,
at equal device memory (issue 29, item 4: choose the split of memory between tiers on a trace).

    traces    shipped and chat, as `bench.memory_pressure` builds them (the public Mooncake trace;
              the seeded generated chat trace)
    device    --shares of the trace's working set (working_set.py), split over the R replicas
    cells     host = 0 (no tier) and host = RATIO x device (--host-ratios, default 0,4): the host
              bytes split between KV and state as the device's are (same mamba_fraction)
    defaults  R = 16, the hybrid router, value eviction, the gpu cost model (host->device copies at
              its host_to_device_bytes_per_s, paid in TTFT by each request whose hit promotes)

Columns: hit tokens and hit rate; hit tokens served through the host tier (hits that promoted any
page: a lower bound on what the tier adds, since a promoted page stays on the device and serves
later hits as a device page); bytes promoted; modeled TTFT p50 / p90; refused prefills. The
router sees both tiers (the index keeps host pages per replica) and prices a replica's host tokens
as its replica would report them (`messages.HostCopyPrice` from the cost model's copy and prefill
speeds). Each run is `hybridserve simulate` (the same `run_one`), in --jobs processes.
Writes rows as JSON (--out, or Parquet when it ends in .parquet) and the table (--markdown).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.memory_pressure import REFERENCE_REPLICAS, trace_path
from cache_service.trace_sim.cli import build_parser, run_one
from cache_service.trace_sim.trace import load_trace, scale_requests

Job = tuple[str, Path, int | None, int, float, float, str, str]  # trace, path, limit, R, share, ratio, eviction, cost


def run_cell(job: Job) -> dict:
    """One simulation: device memory `share` of the working set, host memory `ratio` times that."""
    trace, path, limit, replicas, share, ratio, eviction, cost_model = job
    time_scale = replicas / REFERENCE_REPLICAS  # as memory_pressure: every R at the R = 16 rate
    requests = scale_requests(load_trace(path, limit), 1.0, time_scale, None)
    argv = ["--replicas", str(replicas), "--memory-share", str(share), "--cost-model", cost_model,
            "--no-progress", "--time-scale", str(time_scale)]
    if ratio > 0:
        argv += ["--host-memory-share", str(share * ratio)]
    summary, _ = run_one(build_parser().parse_args(argv), "hybrid", eviction, requests)
    return {"trace": trace, "replicas": replicas, "share": share, "host_ratio": ratio,
            "eviction": summary["eviction"], "cost_model": cost_model,
            "budget_bytes_per_replica": summary["budget_bytes_per_replica"],
            "host_bytes_per_replica": summary["host_bytes_per_replica"],
            "num_requests": summary["num_requests"], "num_input_tokens": summary["num_input_tokens"],
            "num_hit_tokens": summary["num_hit_tokens"], "hit_rate": summary["hit_rate"],
            "num_host_hit_tokens": summary["num_host_hit_tokens"], "host_hit_rate": summary["host_hit_rate"],
            "num_promoted_bytes": summary["num_promoted_bytes"],
            "host_pages_demoted": summary["host_pages_demoted"], "host_pages_promoted": summary["host_pages_promoted"],
            "host_pages_dropped": summary["host_pages_dropped"],
            "num_refused_prefills": summary["num_refused_prefills"],
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p90_s": summary["ttft_s"]["p90"],
            "ttft_mean_s": summary["ttft_s"]["mean"], "wall_s": summary["wall_s"]}


def cell_name(ratio: float) -> str:
    return "no host tier" if ratio == 0 else f"host = {ratio:g}x device"


def markdown(rows: list[dict]) -> str:
    """One line per (trace, R, share, cell), the no-tier cell first; `vs none`: hit tokens over
    the no-tier cell's at the same device memory; `refused prefills`: prompts the device pools
    could not hold at once (nothing of them stored: a budget below the layout's working minimum)."""
    rows = sorted(rows, key=lambda r: (r["trace"], r["replicas"], r["share"], r["host_ratio"]))
    base = {(r["trace"], r["replicas"], r["share"]): r["num_hit_tokens"] for r in rows if r["host_ratio"] == 0}
    lines = ["| trace | R | device share | cell | hit tokens | hit rate | vs none | host hit tokens | "
             "promoted GiB | TTFT p50 (s) | TTFT p90 (s) | refused prefills |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        none = base.get((r["trace"], r["replicas"], r["share"]))
        vs = f"{r['num_hit_tokens'] / none:.2f}" if none else "-"
        lines.append(f"| {r['trace']} | {r['replicas']} | {r['share']:g} | {cell_name(r['host_ratio'])} | "
                     f"{r['num_hit_tokens']:,} | {r['hit_rate']:.4f} | {vs} | {r['num_host_hit_tokens']:,} | "
                     f"{r['num_promoted_bytes'] / 2**30:.1f} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | "
                     f"{r['num_refused_prefills']:,} |")
    return "\n".join(lines) + "\n"


def write_rows(path: str, rows: list[dict], text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        Path(path).write_text(text + "\n")


def emit(report: dict, table: str, out: str | None, markdown_path: str | None, num_runs: int,
         started: float) -> None:
    """A rows benchmark's ending: the table and run time on stderr, the report as JSON on stdout,
    `report["rows"]` to `out` (JSON, or Parquet for a .parquet path), the table to `markdown_path`."""
    print(table, file=sys.stderr)
    print(f"{num_runs} runs in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        write_rows(out, report["rows"], text)
    if markdown_path:
        Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown_path).write_text(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_tier", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="shipped,chat")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--shares", default="0.1,0.25,0.5", help="device memory as shares of the working set")
    p.add_argument("--host-ratios", default="0,4", help="host memory as multiples of the device's (0: none)")
    p.add_argument("--eviction", default="value")
    p.add_argument("--cost-model", default="gpu")
    p.add_argument("--limit", type=int, default=None, help="only each trace's first N requests")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=None, help="rows: JSON, or Parquet for a .parquet path")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    folder = tempfile.TemporaryDirectory(prefix="host-tier-")
    try:
        shares = [float(s) for s in args.shares.split(",")]
        ratios = [float(x) for x in args.host_ratios.split(",")]
        if any(s <= 0 for s in shares) or any(x < 0 for x in ratios):
            raise ValueError(f"--shares must be positive and --host-ratios >= 0, got {args.shares!r}, "
                             f"{args.host_ratios!r}")
        paths = {t: trace_path(t, Path(folder.name)) for t in args.traces.split(",")}
        jobs = [(t, path, args.limit, args.replicas, s, x, args.eviction, args.cost_model)
                for t, path in paths.items() for s in shares for x in ratios]
    except ValueError as exc:
        folder.cleanup()
        print(f"bench.host_tier: {exc}", file=sys.stderr)
        return 2
    rows, start = [], time.perf_counter()
    with folder, ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        try:
            for i, row in enumerate(pool.map(run_cell, jobs), 1):
                rows.append(row)
                print(f"[{i}/{len(jobs)}] {row['trace']} share {row['share']:g} {cell_name(row['host_ratio'])}: "
                      f"hit rate {row['hit_rate']:.4f}, from host {row['host_hit_rate']:.4f}", file=sys.stderr)
        except ValueError as exc:  # a budget too small for the layout, an unknown cost model
            print(f"bench.host_tier: {exc}", file=sys.stderr)
            return 2
    emit({"rows": rows}, markdown(rows), args.out, args.markdown, len(jobs), start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
