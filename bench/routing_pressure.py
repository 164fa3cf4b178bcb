"""`python -m bench.routing_pressure`: hybrid routing's hit tokens as a share of the oracle's, per
trace, cluster size and memory budget: issue 28's routing target (>= 0.95 at R = 16 and 64 on
every trace) measured under memory pressure.

    traces    shipped, chat, agent: the traces of `bench.memory_pressure` (its `trace_path`)
    budgets   --shares of the trace's working set (working_set.py), split over the R replicas
    load      arrivals spread by R / 16, as in `bench.memory_pressure`
    policies  hybrid (the cluster's router), oracle, and a --baseline for context (default
              round_robin: the one that reads no cache state), each at retention `latest`,
              eviction `value`
    oracle    one shared cache with the memory of all R replicas in one pool (R x the per-replica
              budget, i.e. the whole share of the working set), so nothing is held twice and no
              request misses for landing on the wrong replica; compute still goes to the least
              loaded of the R queues (`trace_sim.policies.Oracle`)
    host tier --host-share H gives every replica a host tier (`simulate --host-memory-share`): H
              times the working set over the R replicas, the oracle R x that too (default: none)
    not run   a cell whose per-replica budget gives a group fewer than 2 pages (a state page is
              69 MiB; one is the null block) cannot be built: reported, not failed; the oracle,
              with the budgets pooled, still runs

Check printed under the table (and in the JSON's `checks`), per (trace, R, share):
    hybrid hit tokens >= 0.95 x oracle hit tokens

Each run is `hybridserve simulate` (the same `run_one`), in --jobs processes. Writes JSON
(--out) and a Markdown table (--markdown).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.memory_pressure import REFERENCE_REPLICAS, trace_path
from cache_service.trace_sim.cli import build_parser, run_one
from cache_service.trace_sim.config import SimConfigError
from cache_service.trace_sim.policies import POLICY_NAMES
from cache_service.trace_sim.trace import load_trace, scale_requests

TARGET = 0.95  # hybrid's share of the oracle's hit tokens, issue 28 item 4
RETENTION, EVICTION = "latest", "value"


def run_cell(job: tuple[str, Path, int | None, int, float, str, float | None]) -> dict:
    """One simulated run: `policy` on one trace at R replicas and a share of its working set (and
    a host tier of `host_share` of it, when given)."""
    trace, path, limit, replicas, share, policy, host_share = job
    time_scale = replicas / REFERENCE_REPLICAS
    requests = scale_requests(load_trace(path, limit), 1.0, time_scale, None)
    args = build_parser().parse_args(["--replicas", str(replicas), "--memory-share", str(share),
                                      "--retention", RETENTION, "--no-progress",
                                      "--time-scale", str(time_scale),  # recorded in the summary
                                      *(["--host-memory-share", str(host_share)] if host_share else [])])
    cell = {"trace": trace, "replicas": replicas, "share": share, "policy": policy, "host_share": host_share}
    try:
        summary, _ = run_one(args, policy, EVICTION, requests)
    except SimConfigError as exc:  # a replica's budget below 2 pages of some group: nothing to run
        return dict(cell, num_hit_tokens=None, hit_rate=None, error=str(exc))
    keys = ("num_requests", "num_input_tokens", "num_hit_tokens", "hit_rate", "num_transfer_tokens",
            "num_refused_prefills", "budget_bytes_per_replica", "host_bytes_per_replica", "num_host_hit_tokens")
    return dict(cell, **{k: summary[k] for k in keys})


def hit_tokens(rows: list[dict]) -> dict[tuple, dict[str, int]]:
    """(trace, R, share) -> policy -> hit tokens, in the rows' order."""
    by_key: dict[tuple, dict[str, int]] = {}
    for r in rows:
        by_key.setdefault((r["trace"], r["replicas"], r["share"]), {})[r["policy"]] = r["num_hit_tokens"]
    return by_key


def share_of(hits: int | None, oracle: int | None) -> float | None:
    """`hits` over the oracle's; None where either is missing or the oracle hit nothing."""
    return hits / oracle if hits is not None and oracle else None


def checks(rows: list[dict], target: float = TARGET) -> list[dict]:
    """One entry per (trace, R, share) that has both hybrid and oracle rows: hybrid's share of the
    oracle's hit tokens and whether it reaches `target` (an oracle that hits nothing is matched
    by any hybrid). `holds` is None, with the reason, where a run could not be made."""
    errors = {(r["trace"], r["replicas"], r["share"]): r["error"] for r in rows
              if r.get("error") and r["policy"] in ("hybrid", "oracle")}
    out = []
    for key, hits in hit_tokens(rows).items():
        if "hybrid" not in hits or "oracle" not in hits:
            continue
        hybrid, oracle = hits["hybrid"], hits["oracle"]
        entry = {"trace": key[0], "replicas": key[1], "share": key[2], "check": f"hybrid >= {target:g} x oracle",
                 "hybrid_hit_tokens": hybrid, "oracle_hit_tokens": oracle,
                 "hybrid_over_oracle": share_of(hybrid, oracle)}
        if key in errors:
            out.append(dict(entry, holds=None, not_run=errors[key]))
        else:
            out.append(dict(entry, holds=hybrid >= target * oracle))
    return out


def markdown(rows: list[dict], found: list[dict], target: float = TARGET) -> str:
    """The table: per (trace, R, share) each policy's hit rate, hybrid's and the baseline's share
    of the oracle's hit tokens, and the check; then the failures."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    baselines = [p for p in policies if p not in ("hybrid", "oracle")]
    held = {(c["trace"], c["replicas"], c["share"]): "not run" if c["holds"] is None else c["holds"]
            for c in found}
    rate = {(r["trace"], r["replicas"], r["share"], r["policy"]): r["hit_rate"] for r in rows}
    header = ["trace", "R", "share", *(f"{p} hit rate" for p in policies), "hybrid / oracle",
              *(f"{b} / oracle" for b in baselines), f">= {target:g}"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for key, hits in hit_tokens(rows).items():
        ok = held.get(key)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | "
                     + " | ".join(fmt(rate.get((*key, p))) for p in policies)
                     + f" | {fmt(share_of(hits.get('hybrid'), hits.get('oracle')))} | "
                     + "".join(f"{fmt(share_of(hits.get(b), hits.get('oracle')))} | " for b in baselines)
                     + {None: "-", True: "yes", False: "**no**", "not run": "not run"}[ok] + " |")
    failed = [c for c in found if c["holds"] is False]
    not_run = [c for c in found if c["holds"] is None]
    lines.append("")
    lines.append(f"checks: {len(found) - len(failed) - len(not_run)} of {len(found)} hold"
                 + (f", {len(not_run)} not run" if not_run else ""))
    for c in failed:
        ratio = fmt(c["hybrid_over_oracle"])
        lines.append(f"- fails: hybrid / oracle on {c['trace']} R={c['replicas']} share {c['share']:g}: "
                     f"{ratio} < {target:g} ({c['hybrid_hit_tokens']} vs {c['oracle_hit_tokens']} hit tokens)")
    for c in not_run:
        lines.append(f"- not run: {c['trace']} R={c['replicas']} share {c['share']:g}: {c['not_run']}")
    return "\n".join(lines) + "\n"


def parse_jobs(args: argparse.Namespace, folder: Path) -> list[tuple]:
    """The runs to do, or ValueError with a message naming the bad option."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    try:
        replicas = [int(r) for r in args.replicas.split(",")]
        shares = [float(s) for s in args.shares.split(",")]
    except ValueError:
        raise ValueError(f"--replicas takes integers and --shares numbers, comma-separated; "
                         f"got {args.replicas!r} and {args.shares!r}") from None
    if any(r < 1 for r in replicas):
        raise ValueError(f"--replicas must all be >= 1, got {args.replicas!r}")
    if any(not s > 0 for s in shares):
        raise ValueError(f"--shares must all be positive, got {args.shares!r}")
    if args.host_share is not None and not args.host_share > 0:
        raise ValueError(f"--host-share must be positive, got {args.host_share}")
    others = [p for p in POLICY_NAMES if p not in ("hybrid", "oracle")]
    baseline = [] if args.baseline == "none" else [args.baseline]
    if baseline and args.baseline not in others:
        raise ValueError(f"--baseline must be one of {', '.join(others)} or none, got {args.baseline!r}")
    paths = {t: trace_path(t, folder) for t in args.traces.split(",")}
    return [(t, path, args.limit, r, s, p, args.host_share) for t, path in paths.items() for r in replicas
            for s in shares for p in ("hybrid", "oracle", *baseline)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing_pressure", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="shipped,chat,agent")
    p.add_argument("--replicas", default="16,64")
    p.add_argument("--shares", default="0.1,0.25,0.5,1.0")
    p.add_argument("--baseline", default="round_robin", help="a third policy for context, or 'none'")
    p.add_argument("--host-share", type=float, default=None,
                   help="a host tier per replica: this share of the working set over the replicas (default: none)")
    p.add_argument("--limit", type=int, default=None, help="only each trace's first N requests")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    folder = tempfile.TemporaryDirectory(prefix="routing-pressure-")
    try:
        jobs = parse_jobs(args, Path(folder.name))
    except ValueError as exc:
        folder.cleanup()
        print(f"bench.routing_pressure: {exc}", file=sys.stderr)
        return 2
    rows = []
    with folder, ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for i, row in enumerate(pool.map(run_cell, jobs), 1):
            rows.append(row)
            result = (f"not run: {row['error']}" if row.get("error") else
                      f"{row['num_hit_tokens']} hit tokens ({row['hit_rate']:.4f})")
            print(f"[{i}/{len(jobs)}] {row['trace']} R={row['replicas']} share {row['share']:g} "
                  f"{row['policy']}: {result}", file=sys.stderr)
    found = checks(rows)
    table = markdown(rows, found)
    print(table, file=sys.stderr)
    text = json.dumps({"target": TARGET, "retention": RETENTION, "eviction": EVICTION, "host_share": args.host_share,
                       "rows": rows, "checks": found}, indent=2)
    print(text)
    for path, content in ((args.out, text + "\n"), (args.markdown, table)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
