"""`hybridserve simulate`: replay a Mooncake-format trace through R simulated replicas.

    hybridserve simulate --trace bench/traces/mooncake_synthetic_trace.jsonl.gz --replicas 16 \
        --layout nemotron-nano-9b-v2 --policy hybrid --retention latest --eagle off \
        --out runs/sim-hybrid.json [--parquet runs/sim-hybrid.parquet] [--plot runs/sim.png] \
        [--host-memory-gib 80]   # a host tier under each replica's pools (promotions priced in TTFT)
        [--decode-model stepped] # decode steps: prefill chunks stall them, per-token latencies (ITL)
        [--pd-split 10:6]        # 10 prefill + 6 decode replicas, hand-offs priced (stepped)

Writes a summary JSON (and per-request Parquet with --parquet); `--policy all` runs every policy
on the same trace and adds each one's hit tokens as a ratio of the oracle's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from cache_service.checkpoint_grid import GRIDS
from cache_service.eviction import EVICTION_NAMES, EvictionConfig
from cache_service.router import RouterConfig
from cache_service.specs import SpecError
from cache_service.trace_sim.config import SimConfigError, SimLayout, load_cost_model, load_layout
from cache_service.trace_sim.engine import DECODE_MODELS, SimSettings, record_dict
from cache_service.trace_sim.pd_split import PdSplit
from cache_service.trace_sim.policies import POLICY_NAMES
from cache_service.trace_sim.stepped_engine import make_cluster_sim
from cache_service.trace_sim.summary import summarize
from cache_service.trace_sim.trace import TraceError, load_trace, scale_requests
from cache_service.trace_sim.tuning import run_bootstrapped, ticks, tune_marconi_alpha
from cache_service.trace_sim.working_set import working_set_bytes

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "mooncake_synthetic_trace.jsonl.gz"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridserve simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake JSONL (.jsonl or .jsonl.gz)")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--layout", default="nemotron-nano-9b-v2", help="a name in configs/sim/layouts.yaml")
    p.add_argument("--cost-model", default="gpu", help="a name in configs/sim/cost.yaml")
    p.add_argument("--policy", default="hybrid", help=f"one of {', '.join(POLICY_NAMES)}, or 'all'")
    p.add_argument("--retention", default="latest", help="latest, dense, a token interval, or value:BYTES")
    p.add_argument("--eviction", default="value",
                   help="which retained Mamba state goes under pressure: value[:T|auto], lru, marconi[:ALPHA] "
                        "(value:T: tau T x the mean reuse distance, default 2; value:auto: T and admission "
                        "learned per replica from regretted evictions) "
                        "(marconi alone: ALPHA 0, then tuned on a bootstrap window as Marconi's code does: "
                        "cache_service/trace_sim/tuning.py), or 'all'")
    p.add_argument("--eagle", default="off", choices=("off", "drop", "lossless"))
    p.add_argument("--checkpoint-grid", default="mamba", choices=GRIDS,
                   help="where Mamba states sit: mamba (each Mamba group's block, default) | attention (the "
                        "KV block; the Mamba block only bounds the spacing, as engine.checkpoint_grid)")
    p.add_argument("--memory-gib", type=float, default=20.0, help="cache memory per replica (KV + state)")
    p.add_argument("--memory-share", type=float, default=None,
                   help="instead of --memory-gib: the cluster's cache memory as this share of the trace's "
                        "working set (working_set.py), split over the replicas")
    p.add_argument("--host-memory-gib", type=float, default=0.0,
                   help="host-tier memory per replica (pages the device evicts; 0: no host tier), "
                        "split between KV and state as the device memory is")
    p.add_argument("--host-memory-share", type=float, default=None,
                   help="instead of --host-memory-gib: the cluster's host memory as this share of the "
                        "trace's working set, split over the replicas")
    p.add_argument("--mamba-fraction", type=float, default=0.25, help="share of that memory for state pages")
    p.add_argument("--seed", type=int, default=0,
                   help="the routers' tie-breaks and power_of_two's draws (at R > 1 a run is chaotic: compare seeds)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="divide arrival times by this (2 = twice the request rate)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="tokens per 512-token trace block as a fraction (the slice `loadtest trace --scale` sends)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="cut longer prompts (prefix kept)")
    p.add_argument("--junction-credit", type=float, default=RouterConfig().junction_credit,
                   help="hybrid router: share of the attention match beyond the hit credited as saved")
    p.add_argument("--transfer-may-evict", action="store_true",
                   help="hybrid router: let a planned transfer land on a replica that must evict cached pages "
                        "for it (default: only where its pages fit into empty blocks, router.transfer_may_evict)")
    p.add_argument("--decode-model", default=None, choices=DECODE_MODELS,
                   help="independent (default without --pd-split): decode beside each prefill queue; stepped: "
                        "decode steps that prefill chunks stall (step_timeline.py), with inter-token latencies")
    p.add_argument("--pd-split", default=None, metavar="P:D",
                   help="P prefill + D decode replicas (P + D = --replicas; stepped model); absent: mixed replicas")
    p.add_argument("--out", default=None, help="summary JSON path (default: stdout only)")
    p.add_argument("--parquet", default=None, help="per-request records (one file; 'all' adds a policy column)")
    p.add_argument("--plot", default=None, help="PNG: hit rate, TTFT CDF and memory split per policy")
    p.add_argument("--no-progress", action="store_true")
    return p


def budgets(args: argparse.Namespace, requests: list, layout: SimLayout) -> tuple[int, int]:
    """(device, host) cache bytes per replica: GiB, or shares of the working set over R replicas."""
    def per_replica(gib: float, share: float | None, flag: str) -> int:
        if share is None:
            return int(gib * 2**30)
        if not share > 0:
            raise ValueError(f"{flag} must be positive, got {share}")
        return int(share * working_set_bytes(requests, layout) / args.replicas)

    return (per_replica(args.memory_gib, args.memory_share, "--memory-share"),
            per_replica(args.host_memory_gib, args.host_memory_share, "--host-memory-share"))


def _bar(description: str, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="req", file=sys.stderr, leave=False)


def run_one(args: argparse.Namespace, policy: str, eviction: str, requests: list) -> tuple[dict, list[dict]]:
    layout = load_layout(args.layout)
    budget, host = budgets(args, requests, layout)
    settings = SimSettings(
        layout=layout, cost=load_cost_model(args.cost_model), num_replicas=args.replicas,
        policy=policy, budget_bytes=budget, retention=args.retention, eviction=eviction, eagle=args.eagle,
        mamba_fraction=args.mamba_fraction, host_bytes=host, seed=args.seed,
        router=RouterConfig(junction_credit=args.junction_credit, transfer_may_evict=args.transfer_may_evict),
        decode_model=args.decode_model or ("stepped" if args.pd_split else "independent"),
        pd_split=PdSplit.parse(args.pd_split) if args.pd_split else None, checkpoint_grid=args.checkpoint_grid)
    tuning = None
    if eviction == "marconi":  # no alpha given: alpha 0, then tuned on a bootstrap window, as published
        tuning = tune_marconi_alpha(settings, requests, progress=None if args.no_progress else _bar)
        settings = replace(settings, eviction="marconi:0")
    sim = make_cluster_sim(settings)
    bar = None if args.no_progress else _bar(policy, len(requests))
    start, cpu = time.perf_counter(), time.process_time()
    on_step = ticks(bar)
    records = run_bootstrapped(sim, requests, tuning, on_step) if tuning else sim.run(requests, on_step)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if bar is not None:
        bar.close()
    name = f"marconi:{tuning.alpha}" if tuning else settings.eviction  # the alpha it ran with after tuning
    rows = [dict(record_dict(r), policy=policy, eviction=name) for r in records]
    summary = summarize(sim, records, wall)
    summary["eviction"] = name
    if args.memory_share is not None:
        summary["memory_share"] = args.memory_share
    if args.host_memory_share is not None:
        summary["host_memory_share"] = args.host_memory_share
    if tuning is not None:
        summary["marconi_tuning"] = tuning.as_dict()
    summary["time_scale"] = args.time_scale
    summary["cpu_s"] = cpu  # this process's CPU time: the rate on a shared machine, beside wall_s
    summary["simulated_requests_per_cpu_s"] = len(records) / cpu if cpu > 0 else 0.0
    return summary, rows


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    policies = list(POLICY_NAMES) if args.policy == "all" else [args.policy]
    evictions = list(EVICTION_NAMES) if args.eviction == "all" else [args.eviction]
    if any(p not in POLICY_NAMES for p in policies):
        print(f"hybridserve simulate: unknown policy {args.policy!r}; expected one of "
              f"{', '.join(POLICY_NAMES)} or 'all'", file=sys.stderr)
        return 2
    try:
        for eviction in evictions:
            EvictionConfig(eviction)
        requests = load_trace(args.trace, args.limit)
        if (args.scale, args.time_scale, args.max_prompt_tokens) != (1.0, 1.0, None):
            requests = scale_requests(requests, args.scale, args.time_scale, args.max_prompt_tokens)
        results, rows = {}, []
        for eviction in evictions:
            for policy in policies:
                name = policy if len(evictions) == 1 else f"{policy}/{eviction}"
                results[name], policy_rows = run_one(args, policy, eviction, requests)
                rows.extend(policy_rows)
    except (TraceError, SimConfigError, SpecError, ValueError) as exc:
        print(f"hybridserve simulate: {exc}", file=sys.stderr)
        return 2
    for name, summary in results.items():
        oracle = "oracle" if len(evictions) == 1 else f"oracle/{name.split('/')[1]}"
        if oracle in results:
            oracle_hits = results[oracle]["num_hit_tokens"]
            summary["hit_tokens_vs_oracle"] = summary["num_hit_tokens"] / oracle_hits if oracle_hits else None
    out = next(iter(results.values())) if len(results) == 1 else {"policies": results}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq
        Path(args.parquet).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), args.parquet)
    if args.plot:
        from cache_service.trace_sim.plots import plot_run
        plot_run(results, rows, args.plot)
    return 0
