"""`python -m bench.memory_pressure`: token hit rate per eviction policy, budget, trace and cluster
size: the table issue 28 asks for, with its checks.

    traces    shipped    bench/traces/mooncake_synthetic_trace.jsonl.gz (public Mooncake trace)
              chat       `hybridserve gen-trace --workload chat --sessions 400 --seed 0`
              agent      `hybridserve gen-trace --workload agent --sessions 60 --seed 0`
              (generated into a temporary folder, seeded: the same trace every run)
    budgets   --shares of the trace's working set (working_set.py), split over the R replicas
    load      arrivals are spread by R / 16 (`simulate --time-scale R/16`): every R sees the
              per-replica request rate of the trace at R = 16, so R = 1 is not a queueing test
    cells     (retention, eviction): latest/lru, latest/marconi, latest/value, finer grids under
              value (dense, 512) and placement by expected value (value:3e8: up to 3e8 bytes, 4
              states, per request; `cache_service/placement.py`); `--cells` adds others
              (dense/lru: the old collapse). `marconi` gives two columns: `latest/marconi`,
              its best setting in hindsight (every alpha in tuning.MARCONI_ALPHAS run on the whole
              trace, the highest hit rate kept), and `latest/marconi-published`, Marconi as its
              code runs: alpha 0, then tuned once on a bootstrap window (5 x the requests before
              the first eviction, replayed with alphas 0-2), as `simulate --eviction marconi`
              does (cache_service/trace_sim/tuning.py)

Checks printed under the table (and in the JSON's `checks`):
    value >= marconi          on every (trace, R, share), both at `latest`, against each of
                              Marconi's two columns; and value with placement (value:3e8)
                              against the same
    value >= 1.5 x lru        at the 25% share, both at `latest`
    grid >= latest            dense, 512 and value:3e8 under value, every budget

Seeds: at R > 1 a cell is a chaotic process (a tie-break placed differently re-routes and
re-evicts enough to move the hit rate by several percent), so `--seeds N` runs each R > 1 cell
with `simulate --seed` 0..N-1 (the router's tie-breaks) and the table and checks use the mean,
with each row's largest max - min over its cells as `spread`; Marconi's hindsight column takes its
best alpha per seed. R = 1 has no routing choice and runs once (its figures do not depend on the
seed).

Each run is `hybridserve simulate` (the same `run_one`), in --jobs processes (~25 min with 2 and
one seed). Writes JSON (--out) and a Markdown table (--markdown).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cache_service.trace_sim.cli import DEFAULT_TRACE, build_parser, run_one
from cache_service.trace_sim.generate import GenConfig, generate, write_trace
from cache_service.trace_sim.trace import load_trace, scale_requests
from cache_service.trace_sim.tuning import MARCONI_ALPHAS

PLACED = "value:3e8"  # placement by expected value: up to 4 Nemotron-Nano-9B-v2 states per request
CELLS = (("latest", "lru"), ("latest", "marconi"), ("latest", "value"),
         ("dense", "value"), ("512", "value"), (PLACED, "value"), ("dense", "lru"))  # the table's column order
DEFAULT_CELLS = CELLS[:6]
GENERATED = {"chat": GenConfig("chat", 400, seed=0), "agent": GenConfig("agent", 60, seed=0)}
REFERENCE_REPLICAS = 16


def trace_path(name: str, folder: Path) -> Path:
    """The shipped trace, or a generated one written under `folder`."""
    if name == "shipped":
        return DEFAULT_TRACE
    if name in GENERATED:
        return write_trace(generate(GENERATED[name]), folder / f"{name}.jsonl.gz")
    raise ValueError(f"unknown trace {name!r}; expected shipped, {', '.join(GENERATED)}")


AUTO = "value:auto"  # value with T and its admission learned per pool (`cache_service/adaptive_value.py`)
MARCONI_COLUMNS = ("marconi", "marconi-published")  # best alpha in hindsight; as its code tunes it


def run_cell(job: tuple[str, Path, int | None, int, float, str, str, int]) -> list[dict]:
    """One table cell's rows at one seed: one, or Marconi's two (best alpha in hindsight, as its
    code tunes it)."""
    trace, path, limit, replicas, share, retention, eviction, seed = job
    time_scale = replicas / REFERENCE_REPLICAS
    requests = scale_requests(load_trace(path, limit), 1.0, time_scale, None)
    args = build_parser().parse_args(["--replicas", str(replicas), "--memory-share", str(share),
                                      "--retention", retention, "--no-progress", "--seed", str(seed),
                                      "--time-scale", str(time_scale)])  # recorded in the summary
    if eviction == "marconi":
        runs = [run_one(args, "hybrid", f"marconi:{a}", requests)[0] for a in MARCONI_ALPHAS]
        best = max(runs, key=lambda s: s["hit_rate"])  # the first of equals: the smallest alpha
        published, _ = run_one(args, "hybrid", "marconi", requests)  # alpha 0, then its bootstrap tuning
        picked = [("marconi", best), ("marconi-published", published)]
    else:
        summary, _ = run_one(args, "hybrid", eviction, requests)
        picked = [(eviction, summary)]  # value:T keeps its T: its own column beside value
    return [{"trace": trace, "replicas": replicas, "share": share, "retention": retention, "seed": seed,
             "cell": f"{retention}/{column}", "eviction": summary["eviction"], "hit_rate": summary["hit_rate"],
             "flops_saved_share": summary["flops_saved_share"], "state_turnover": summary["state_turnover"],
             "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p95_s": summary["ttft_s"]["p95"],
             **({"marconi_tuning": summary["marconi_tuning"]} if "marconi_tuning" in summary else {})}
            for column, summary in picked]


def cell_name(row: dict) -> str:
    return row.get("cell") or f"{row['retention']}/{row['eviction'].split(':')[0]}"


def seed_runs(rows: list[dict]) -> dict[tuple, dict[str, list[float]]]:
    """(trace, R, share) -> cell name -> the hit rate of each seed run, in the rows' order."""
    by_key: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        cells = by_key.setdefault((r["trace"], r["replicas"], r["share"]), {})
        cells.setdefault(cell_name(r), []).append(r["hit_rate"])
    return by_key


def hit_rates(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(trace, R, share) -> cell name -> hit rate (the mean over its seed runs), in the rows' order."""
    return means(seed_runs(rows))


def means(runs: dict[tuple, dict[str, list[float]]]) -> dict[tuple, dict[str, float]]:
    """`seed_runs`' grouping with each cell's runs replaced by their mean."""
    return {key: {name: sum(v) / len(v) for name, v in cells.items()} for key, cells in runs.items()}


def spread(runs: dict[str, list[float]]) -> float:
    """The largest max - min over one row's cells (0 with one seed)."""
    return max((max(v) - min(v) for v in runs.values()), default=0.0)


def checks(rows: list[dict]) -> list[dict]:
    """One entry per comparison the issue sets, with the two hit rates and whether it holds; for
    `latest/value`, and for `latest/value:auto` when it was run (its own checks, named so)."""
    out = []
    for (trace, replicas, share), hits in sorted(hit_rates(rows).items()):
        where = {"trace": trace, "replicas": replicas, "share": share}
        value = hits.get("latest/value")
        for name, ours in (("value", value), (AUTO, hits.get(f"latest/{AUTO}"))):
            if ours is None:
                continue
            for column in MARCONI_COLUMNS:
                marconi = hits.get(f"latest/{column}")
                if marconi is not None:
                    out.append(dict(where, check=f"{name} >= {column}", left=ours, right=marconi,
                                    holds=ours >= marconi))
            if share == 0.25 and "latest/lru" in hits:
                out.append(dict(where, check=f"{name} >= 1.5 x lru", left=ours, right=1.5 * hits["latest/lru"],
                                holds=ours >= 1.5 * hits["latest/lru"]))
        if value is None:
            continue
        placed = hits.get(f"{PLACED}/value")
        for column in MARCONI_COLUMNS:  # ours with placement too (Marconi's admission is latest's positions)
            marconi = hits.get(f"latest/{column}")
            if placed is not None and marconi is not None:
                out.append(dict(where, check=f"{PLACED}/value >= {column}", left=placed, right=marconi,
                                holds=placed >= marconi))
        for grid in ("dense/value", "512/value", f"{PLACED}/value"):
            if grid in hits:
                out.append(dict(where, check=f"{grid} >= latest/value", left=hits[grid], right=value,
                                holds=hits[grid] >= value))
    return out


def markdown(rows: list[dict], found: list[dict]) -> str:
    present = list(dict.fromkeys(cell_name(x) for x in rows))
    known = [f"{r}/{c}" for r, e in CELLS for c in (MARCONI_COLUMNS if e == "marconi" else (e,))]
    names = [n for n in known if n in present] + [n for n in present if n not in known]
    runs = seed_runs(rows)
    seeded = any(len(v) > 1 for cells in runs.values() for v in cells.values())
    extra, rule = (" spread |", " --- |") if seeded else ("", "")
    auto = f"latest/{AUTO}" in present
    if auto:
        extra, rule = " auto / marconi | auto / published |" + extra, " --- | --- |" + rule
    lines = ["| trace | R | share | " + " | ".join(names) + " | value / marconi | value / published | value / lru |"
             + extra,
             "| --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- | --- |" + rule]
    for (trace, replicas, share), hits in means(runs).items():
        v, m, lru = hits.get("latest/value"), hits.get("latest/marconi"), hits.get("latest/lru")
        mp, learned = hits.get("latest/marconi-published"), hits.get(f"latest/{AUTO}")
        ratio = lambda a, b: f"{a / b:.2f}" if a is not None and b else "-"  # noqa: E731
        lines.append(f"| {trace} | {replicas} | {share:g} | "
                     + " | ".join(f"{hits[n]:.4f}" if n in hits else "-" for n in names)
                     + f" | {ratio(v, m)} | {ratio(v, mp)} | {ratio(v, lru)} |"
                     + (f" {ratio(learned, m)} | {ratio(learned, mp)} |" if auto else "")
                     + (f" {spread(runs[(trace, replicas, share)]):.4f} |" if seeded else ""))
    failed = [c for c in found if not c["holds"]]
    lines.append("")
    lines.append(f"checks: {len(found) - len(failed)} of {len(found)} hold")
    for c in failed:
        lines.append(f"- fails: {c['check']} on {c['trace']} R={c['replicas']} share {c['share']:g}: "
                     f"{c['left']:.4f} vs {c['right']:.4f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_pressure", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="shipped,chat")
    p.add_argument("--replicas", default="1,16")
    p.add_argument("--shares", default="0.1,0.25,0.5,1.0")
    p.add_argument("--cells", default=",".join(f"{r}/{e}" for r, e in DEFAULT_CELLS),
                   help="retention/eviction pairs, comma-separated")
    p.add_argument("--limit", type=int, default=None, help="only each trace's first N requests")
    p.add_argument("--seeds", type=int, default=1,
                   help="runs per R > 1 cell, simulate --seed 0..N-1; the table gives the mean (R = 1 runs once)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (1: in this process)")
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    folder = tempfile.TemporaryDirectory(prefix="memory-pressure-")
    try:
        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        cells = [tuple(c.split("/", 1)) for c in args.cells.split(",")]
        if any(len(c) != 2 for c in cells):
            raise ValueError(f"--cells takes retention/eviction pairs, got {args.cells!r}")
        paths = {t: trace_path(t, Path(folder.name)) for t in args.traces.split(",")}
        jobs = [(t, path, args.limit, int(r), float(s), ret, ev, seed) for t, path in paths.items()
                for r in args.replicas.split(",") for s in args.shares.split(",") for ret, ev in cells
                for seed in range(args.seeds if int(r) > 1 else 1)]
    except ValueError as exc:
        folder.cleanup()
        print(f"bench.memory_pressure: {exc}", file=sys.stderr)
        return 2
    rows = []
    with folder, contextlib.ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(max_workers=args.jobs)) if args.jobs > 1 else None
        for i, cell_rows in enumerate(pool.map(run_cell, jobs) if pool else map(run_cell, jobs), 1):
            rows.extend(cell_rows)
            for row in cell_rows:
                print(f"[{i}/{len(jobs)}] {row['trace']} R={row['replicas']} share {row['share']:g} "
                      f"{cell_name(row)} ({row['eviction']}) seed {row['seed']}: {row['hit_rate']:.4f}",
                      file=sys.stderr)
    found = checks(rows)
    table = markdown(rows, found)
    print(table, file=sys.stderr)
    text = json.dumps({"rows": rows, "checks": found}, indent=2)
    print(text)
    for path, content in ((args.out, text + "\n"), (args.markdown, table)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
