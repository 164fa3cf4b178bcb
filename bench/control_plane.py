"""`python -m bench.control_plane`: the control plane at R = 8, 64, 256 replicas, as JSON and a table.

Simulated replicas (`bench.sim_replicas`: real Ray actors answering from synthetic caches, each
with the production event publisher) resync into a real cache-service actor and push churn
while a front door routes prompts (asyncio, `concurrency` decisions in flight, each hashing its
prompt), two ways:
    read replica   the default: the front door's copy of the index, kept in step with the
                   service's op log by a follower thread (`cluster.frontdoor.index_follower`)
    service        `cluster.cache_service.read_replica: false`: one `route_many` call per batch of decisions
Beside them, the same decisions in process (hash + `CacheService.route` on an index with the
same content, no Ray, no churn). Each Ray measurement runs `--repeats` times on the same
cluster; the table gives the median and the 1-minute load average after the last one.

    decisions/s, p50/p99 ms     per R and way; at a paced `paced_rate`/s (open loop) and closed loop
    growth                      per-decision cost at the largest R over the smallest
    index bytes per 1M entries  tracemalloc around 1M resynced entries
    resync s for 1M entries     in process, and through Ray (a simulated replica's chunked resync)
    kill during resync          the service is killed during a 1M-entry resync: decisions keep
                                coming (by load), and the replica's index is back afterwards
    tiny requests               16 prompt tokens, 1 output token, concurrency 32: the Ray backend's
                                requests/s over the in-process backend's (`--tiny`, needs the model)

Targets (issue 33): R = 64: p99 <= 10 ms at 1,000 decisions/s and >= 2,000 decisions/s; R = 256:
p99 <= 25 ms at 1,000/s; cost growth 8 -> 256 <= 2x; tiny >= 0.7.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import time
import tracemalloc
from dataclasses import asdict
from pathlib import Path

from bench.plane_common import PlaneConfig, _prompts, in_process
from bench.plane_ray import growth_equal_hits, resync_through_ray, through_ray
from bench.reports import default_report, write_report
from bench.sim_replicas import document_hashes

TINY_TRAINED = str(Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny-trained")

__all__ = ["PlaneConfig", "_prompts", "in_process", "through_ray", "resync_through_ray", "growth_equal_hits",
           "run_all", "format_table", "main"]


# ---- memory and resync ---------------------------------------------------------------------------------
def index_memory(num_entries: int) -> dict:
    from cache_service.global_index import GlobalIndex

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    keys = [os.urandom(16) for _ in range(num_entries)]  # the keys live in the index (they arrive with events)
    index = GlobalIndex(3)
    index.begin_resync("r", "m")
    third = num_entries // 3
    for g, part in enumerate((keys[:third], keys[third: 2 * third], keys[2 * third:])):
        index.resync_chunk("r", "m", g, part)
    del keys  # the list itself is not index memory; the key objects stay referenced by the index
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"bytes_per_entry_incl_keys": round(used / num_entries, 1),
            "mib_per_1m_entries": round(used / num_entries * 1e6 / 2**20, 1)}


def resync_in_process(num_entries: int) -> float:
    from cache_service.global_index import GlobalIndex

    keys = [os.urandom(16) for _ in range(num_entries)]
    index = GlobalIndex(3)
    t0 = time.perf_counter()
    index.begin_resync("r", "x")
    for i in range(0, num_entries, 65536):
        index.resync_chunk("r", "x", 0, keys[i: i + 65536])
    index.end_resync("r", "x", 0)
    return time.perf_counter() - t0


# ---- all of it ----------------------------------------------------------------------------------------------
def run_all(config: PlaneConfig, tiny: bool, model_dir: str) -> dict:
    from cache_service.simulate import make_tokens
    from cluster.control.ray_cluster import start_local_ray

    rng = random.Random(config.seed)
    docs_tokens = [make_tokens(config.prompt_len, config.seed * 100_003 + d, 128_000)
                   for d in range(config.num_prefixes)]
    docs = document_hashes(config.num_prefixes, config.prompt_len, config.seed)
    prompts = _prompts(config, docs_tokens, rng)
    report: dict = {"config": asdict(config), "routing": {}}
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rp", dir="/tmp"))
    start_local_ray(num_cpus=2)
    for r in config.replicas:
        report["routing"][r] = {"in_process": in_process(config, r, docs, prompts),
                                "ray": through_ray(config, r, docs, prompts)}
        for n in (n for n in config.shards if n > 1):
            report["routing"][r][f"ray_{n}_shards"] = through_ray(config, r, docs, prompts, n)
        print(f"R={r}: {report['routing'][r]}", file=sys.stderr)
    lo, hi = min(config.replicas), max(config.replicas)
    for kind, pick in (("in_process", lambda v: v["in_process"]), ("read_replica", lambda v: v["ray"]["read_replica"]),
                       ("service", lambda v: v["ray"]["service"])):
        a, b = pick(report["routing"][lo]), pick(report["routing"][hi])
        report.setdefault("growth", {})[kind] = round(a["decisions_per_s"] / b["decisions_per_s"], 2)
    report["growth_equal_hits"] = growth_equal_hits(config, lo, hi)
    report["index_memory"] = index_memory(config.resync_entries)
    report["resync_1m"] = {"in_process_s": round(resync_in_process(config.resync_entries), 2),
                           **resync_through_ray(config, docs, prompts, kill_midway=False)}
    report["kill_during_resync"] = resync_through_ray(config, docs, prompts, kill_midway=True)
    if max(config.shards) > 1:
        report["kill_during_resync_sharded"] = resync_through_ray(config, docs, prompts, kill_midway=True,
                                                                  num_shards=max(config.shards))
    if tiny:
        from bench.tiny_requests import tiny_requests

        report["tiny_requests"] = tiny_requests(model_dir, 400, 32)
    return report


def format_table(report: dict) -> str:
    rate = report["config"]["paced_rate"]
    rows = [f"median of {report['config']['repeats']} runs per row; load: 1-minute load average after them",
            f"{'R':>5}  {'way':<13}{'max dec/s':>10}{f'at {rate:.0f}/s p50 ms':>18}{'p99 ms':>8}{'load':>6}",
            "-" * 60]
    for r, v in report["routing"].items():
        ways = [("read replica", v["ray"]["read_replica"], v["ray"]),
                ("service", v["ray"]["service"], v["ray"])]
        ways += [(f"{k.split('_')[1]} shards", v[k]["read_replica"], v[k]) for k in v if k.endswith("_shards")]
        for way, a, run in ways:
            paced = a[f"at_{rate:.0f}_per_s"]
            rows.append(f"{r:>5}  {way:<13}{a['decisions_per_s']:>10.0f}{paced['p50_ms']:>18.2f}"
                        f"{paced['p99_ms']:>8.2f}{run['load_avg_1m']:>6.2f}")
        b = v["in_process"]
        rows.append(f"{r:>5}  {'in process':<13}{b['decisions_per_s']:>10.0f}{'':>18}{b['p99_ms']:>8.2f}"
                    "  (closed loop p99)")
    rows.append(f"cost growth (R min -> max): {report['growth']}")
    eq = report["growth_equal_hits"]
    rows.append(f"cost growth at equal hits (documents x R): {eq['growth']} "
                f"({', '.join(f'R={r}: {v}' for r, v in eq.items() if r != 'growth')})")
    rows.append(f"index memory: {report['index_memory']}")
    rows.append(f"resync of 1M entries: {report['resync_1m']}")
    rows.append(f"service killed during a 1M-entry resync: {report['kill_during_resync']}")
    if "kill_during_resync_sharded" in report:
        rows.append(f"  the same, sharded (the replica's shard killed): {report['kill_during_resync_sharded']}")
    if "tiny_requests" in report:
        rows.append(f"tiny requests (16 in, 1 out, concurrency 32): {report['tiny_requests']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="8,64,256", help="comma-separated R values")
    p.add_argument("--decisions", type=int, default=PlaneConfig.decisions)
    p.add_argument("--repeats", type=int, default=PlaneConfig.repeats, help="Ray measurements per R and way")
    p.add_argument("--shards", default="1,2", help="comma-separated index shard counts measured (1 is always run)")
    p.add_argument("--resync-entries", type=int, default=PlaneConfig.resync_entries)
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny-request comparison (needs the model)")
    p.add_argument("--model", default=TINY_TRAINED)
    p.add_argument("--out", default=default_report("control-plane"), help="JSON report path (default: under out/)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    config = PlaneConfig(replicas=tuple(int(x) for x in args.replicas.split(",")), decisions=args.decisions,
                         resync_entries=args.resync_entries, repeats=args.repeats,
                         shards=tuple(sorted({1, *(int(x) for x in args.shards.split(","))})))
    report = run_all(config, not args.no_tiny, args.model)
    print(format_table(report))
    write_report(args.out, report)
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
