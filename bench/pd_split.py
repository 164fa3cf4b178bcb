"""`python -m bench.pd_split`: mixed replicas vs every prefill:decode split of R replicas on a
trace, under the simulator's stepped decode model (issue 31: choose the split for a trace).

    trace     the shipped Mooncake trace (--trace for another)
    cells     mixed (R replicas that prefill and decode, prefill chunks stalling decode steps)
              and P:D for P = 1 .. R-1 (R > 16: every (R/16)-th P; --splits for a list)
    load      arrivals spread by R / 16 (`simulate --time-scale R/16`, as bench.memory_pressure):
              every R sees the per-replica request rate of the trace at R = 16
    defaults  R = 16, the hybrid router, 20 GiB of cache per replica, the gpu cost model
              (decode step 12 ms + 0.13 ms per sequence, 2,048 tokens a step, 20 GB/s hand-offs)

Best split: the lowest ITL p99 among the splits whose TTFT p90 is at most (1 + --ttft-slack)
times mixed's (default 10%); ties by ITL p99.9, then TTFT p90. None when no split meets the
bound (the table then says so, with the split of the lowest TTFT p90). Columns: hit rate, TTFT
p50 / p90, ITL p50 / p90 / p99 / p99.9, output tokens/s (first arrival to last token), hand-off
GiB. Each run is `hybridserve simulate` (the same `run_one`) in --jobs processes. Writes rows and
the choice as JSON (--out, or rows as Parquet for a .parquet path) and the table (--markdown).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.host_tier import emit
from bench.memory_pressure import REFERENCE_REPLICAS
from cache_service.trace_sim.cli import DEFAULT_TRACE, build_parser, run_one
from cache_service.trace_sim.trace import load_trace, scale_requests

Job = tuple[str, int | None, int, str, str, float]  # trace path, limit, R, cell, cost model, memory GiB


def default_splits(replicas: int) -> list[str]:
    step = max(1, replicas // REFERENCE_REPLICAS)
    return [f"{p}:{replicas - p}" for p in range(step, replicas, step)]


def run_cell(job: Job) -> dict:
    """One simulation: `cell` is "mixed" or "P:D"."""
    path, limit, replicas, cell, cost_model, memory_gib = job
    time_scale = replicas / REFERENCE_REPLICAS
    requests = scale_requests(load_trace(path, limit), 1.0, time_scale, None)
    argv = ["--replicas", str(replicas), "--cost-model", cost_model, "--memory-gib", str(memory_gib),
            "--decode-model", "stepped", "--no-progress", "--time-scale", str(time_scale)]
    if cell != "mixed":
        argv += ["--pd-split", cell]
    s, _ = run_one(build_parser().parse_args(argv), "hybrid", "value", requests)
    p, d = (int(x) for x in cell.split(":")) if cell != "mixed" else (replicas, 0)
    return {"cell": cell, "replicas": replicas, "num_prefill": p, "num_decode": d, "cost_model": cost_model,
            "num_requests": s["num_requests"], "num_finished": s["num_finished"], "hit_rate": s["hit_rate"],
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"], "ttft_p99_s": s["ttft_s"]["p99"],
            "itl_p50_s": s["itl_s"]["p50"], "itl_p90_s": s["itl_s"]["p90"], "itl_p99_s": s["itl_s"]["p99"],
            "itl_p999_s": s["itl_s"]["p99.9"], "itl_max_s": s["itl_s"]["max"], "itl_mean_s": s["itl_s"]["mean"],
            "output_tokens_per_s": s["output_tokens_per_s"], "handoff_bytes": s["handoff_bytes"],
            "handoff_s_mean": s["handoff_s_mean"], "wall_s": s["wall_s"]}


def best_split(rows: list[dict], ttft_slack: float) -> dict:
    """The choice (module doc): {"best": cell or None, "ttft_p90_bound_s", "feasible": [cells], and
    "lowest_ttft": the split of the lowest TTFT p90}."""
    mixed = next(r for r in rows if r["cell"] == "mixed")
    splits = [r for r in rows if r["cell"] != "mixed"]
    bound = mixed["ttft_p90_s"] * (1.0 + ttft_slack)
    feasible = [r for r in splits if r["ttft_p90_s"] <= bound]
    best = min(feasible, key=lambda r: (r["itl_p99_s"], r["itl_p999_s"], r["ttft_p90_s"]), default=None)
    lowest = min(splits, key=lambda r: (r["ttft_p90_s"], r["itl_p99_s"]), default=None)
    return {"best": best["cell"] if best else None, "ttft_slack": ttft_slack, "ttft_p90_bound_s": bound,
            "feasible": [r["cell"] for r in feasible], "lowest_ttft": lowest["cell"] if lowest else None}


def markdown(rows: list[dict], choice: dict) -> str:
    """Mixed first, then the splits by P; the best split marked, the choice under the table."""
    rows = sorted(rows, key=lambda r: (r["cell"] != "mixed", r["num_prefill"]))
    lines = ["| R | cell | hit rate | TTFT p50 (s) | TTFT p90 (s) | ITL p50 (ms) | ITL p90 (ms) | ITL p99 (ms) | "
             "ITL p99.9 (ms) | output tok/s | hand-off GiB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        name = f"**{r['cell']}** (best)" if r["cell"] == choice["best"] else r["cell"]
        lines.append(f"| {r['replicas']} | {name} | {r['hit_rate']:.3f} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} | {1e3 * r['itl_p50_s']:.2f} | {1e3 * r['itl_p90_s']:.2f} | "
                     f"{1e3 * r['itl_p99_s']:.2f} | {1e3 * r['itl_p999_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['handoff_bytes'] / 2**30:.1f} |")
    bound = f"TTFT p90 <= {choice['ttft_p90_bound_s']:.3f} s (mixed + {choice['ttft_slack']:.0%})"
    if choice["best"] is None:
        lines.append(f"\nNo split meets {bound}; the lowest TTFT p90 is {choice['lowest_ttft']}.")
    else:
        lines.append(f"\nBest split: {choice['best']} (lowest ITL p99 with {bound}).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pd_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--replicas", type=int, default=16, help="R (8-64 is the issue's range)")
    p.add_argument("--splits", default=None, help="P:D cells, comma-separated (default: module doc)")
    p.add_argument("--ttft-slack", type=float, default=0.10, help="a split's TTFT p90 may exceed mixed's by this share")
    p.add_argument("--cost-model", default="gpu")
    p.add_argument("--memory-gib", type=float, default=20.0, help="cache memory per replica")
    p.add_argument("--limit", type=int, default=None, help="only the trace's first N requests")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=None, help="rows and choice: JSON, or rows as Parquet for a .parquet path")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    try:
        if args.replicas < 2:
            raise ValueError(f"--replicas must be >= 2 to split, got {args.replicas}")
        if args.ttft_slack < 0:
            raise ValueError(f"--ttft-slack must be >= 0, got {args.ttft_slack}")
        splits = args.splits.split(",") if args.splits else default_splits(args.replicas)
        for cell in splits:
            parts = cell.split(":")
            if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts) or \
                    int(parts[0]) + int(parts[1]) != args.replicas:
                raise ValueError(f"split {cell!r} is not P:D with P, D >= 1 and P + D = {args.replicas}")
        if not Path(args.trace).is_file():
            raise ValueError(f"trace not found: {args.trace}")
    except ValueError as exc:
        print(f"bench.pd_split: {exc}", file=sys.stderr)
        return 2
    jobs = [(args.trace, args.limit, args.replicas, cell, args.cost_model, args.memory_gib)
            for cell in ["mixed", *splits]]
    rows, start = [], time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        try:
            for i, row in enumerate(pool.map(run_cell, jobs), 1):
                rows.append(row)
                print(f"[{i}/{len(jobs)}] {row['cell']}: TTFT p90 {row['ttft_p90_s']:.3f} s, "
                      f"ITL p99 {1e3 * row['itl_p99_s']:.2f} ms", file=sys.stderr)
        except ValueError as exc:  # an unknown cost model, a budget too small for the layout
            print(f"bench.pd_split: {exc}", file=sys.stderr)
            return 2
    choice = best_split(rows, args.ttft_slack)
    emit({"rows": rows, "choice": choice}, markdown(rows, choice), args.out, args.markdown, len(jobs), start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
