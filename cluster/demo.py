"""`make demo`: the served cluster, warm vs cold, on this machine.

1. The cache core's answer to the seed bug (DESIGN.md section 1): a table built by the same
   simulation `hybridserve explain` runs.
2. The load test against the real thing: for each variant a `hybridserve serve` process
   (embedded Ray on 127.0.0.1, the cache-service actor, 2 replica actors, the HTTP front end)
   with the bundled trained tiny model, driven over streaming HTTP by the `resend` (4K-token
   prompts, sent cold then resent) and `tenants` (shared system prompts, many questions)
   workloads. With a Mamba snapshot every 128 tokens: routing `hybrid`, `attention_overlap`,
   `round_robin`, and the `oracle` (one replica holding every prefix: the hit-rate ceiling);
   EAGLE `lossless` vs `drop`. With sparse snapshots (`latest` only): `hybrid` vs
   `attention_overlap`.
   Servers are stopped after their run; the table, the ratios, and the Parquet / PNG paths print.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cache_service.coordinator import EagleMode
from cache_service.explain import explain
from cache_service.hit_finders import DropRule
from cache_service.simulate import Scenario
from cache_service.specs import parse_group_spec

INTERVAL = 128  # retention of the main comparison: a Mamba snapshot every 128 tokens
GLM = ["full:64", "mamba:2304", "mamba:2304", "mamba:2304"]
NATIVE = ["full:64", "mamba:64", "mamba:64", "mamba:64"]

ROWS = [  # label, groups, EAGLE mode, eagle-aware retention, drop rule
    ("seed bug: vLLM before the fix", GLM, EagleMode.DROP, False, "alignment"),
    ("seed fix (alignment drop + unit-below retention)", GLM, EagleMode.DROP, True, "alignment"),
    ("hybridserve lookahead drop, seed layout", GLM, EagleMode.DROP, True, "lookahead"),
    ("hybridserve lossless EAGLE, seed layout", GLM, EagleMode.LOSSLESS, True, "lookahead"),
    ("hybridserve lossless EAGLE, native 64-token layout", NATIVE, EagleMode.LOSSLESS, True, "lookahead"),
]


def seed_table() -> None:
    print("Identical 8,901-token resend, MTP k=3, latest-only retention\n")
    print(f"{'configuration':<52} {'per-group hits':<28} {'hit':>6}")
    for label, groups, eagle, aware, rule in ROWS:
        scenario = Scenario(
            groups=tuple(parse_group_spec(g) for g in groups), prompt_len=8901, eagle=eagle,
            num_spec_tokens=3, eagle_aware_retention=aware, drop_rule=DropRule(rule),
        )
        report = explain(scenario)
        print(f"{label:<52} {str(report['per_group_hits']):<28} {report['hit_tokens']:>6}")


def headline(dense, sparse) -> list[str]:
    """The issue's targets, checked on this run's numbers. `dense`: summaries of the run with
    interval retention (policies, oracle, drop); `sparse`: latest-only retention (hybrid vs
    attention_overlap). Keys are full variant names; nothing is printed that was not measured."""

    def pick(summaries, policy, workload, eagle="lossless"):
        return next((x for x in summaries if x.workload == workload
                     and x.variant.split("/")[:2] == [policy, eagle]), None)

    lines = []
    r = pick(dense, "hybrid", "resend")
    if r and r.warm_cold_ratio is not None:
        lines.append(f"resend 4K warm/cold TTFT (hybrid): {r.warm_cold_ratio:.3f}  (target <= 0.05)")
    h, o, rr = (pick(dense, p, "tenants") for p in ("hybrid", "oracle", "round_robin"))
    if h and o and h.warm.hit_rate and o.warm.hit_rate:
        lines.append(f"tenants warm hit rate hybrid / oracle single replica: {h.warm.hit_rate:.1%} / "
                     f"{o.warm.hit_rate:.1%} = {h.warm.hit_rate / o.warm.hit_rate:.2f}  (target >= 0.95)")
    if h and rr and h.warm.ttft_p90_s and rr.warm.ttft_p90_s:
        lines.append(f"tenants warm p90 TTFT hybrid / round_robin: {_ms(h.warm.ttft_p90_s)} / "
                     f"{_ms(rr.warm.ttft_p90_s)} ms = {h.warm.ttft_p90_s / rr.warm.ttft_p90_s:.2f}"
                     "  (target <= 0.33)")
    hs, ov = pick(sparse, "hybrid", "tenants"), pick(sparse, "attention_overlap", "tenants")
    if hs and ov and hs.warm.hit_rate is not None and ov.warm.hit_rate is not None:
        lines.append(f"sparse checkpoints (latest only), tenants, hybrid vs attention_overlap: warm hit "
                     f"{hs.warm.hit_rate:.1%} vs {ov.warm.hit_rate:.1%}, warm TTFT p50 {_ms(hs.warm.ttft_p50_s)} vs "
                     f"{_ms(ov.warm.ttft_p50_s)} ms, p90 {_ms(hs.warm.ttft_p90_s)} vs {_ms(ov.warm.ttft_p90_s)} ms")
    for workload in ("resend", "tenants"):
        lo, dr = pick(dense, "hybrid", workload), pick(dense, "hybrid", workload, "drop")
        if lo and dr and lo.warm.hit_rate is not None and dr.warm.hit_rate is not None:
            lines.append(f"{workload} warm hit rate lossless vs drop: {lo.warm.hit_rate:.1%} vs {dr.warm.hit_rate:.1%}")
    return lines


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.0f}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    from cluster.loadtest.__main__ import write_outputs
    from cluster.loadtest.compare import format_ratios, make_variants, run_compare
    from cluster.loadtest.report import format_summaries, summarize
    from cluster.loadtest.workloads import WorkloadConfig

    p = argparse.ArgumentParser(prog="python -m cluster.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--out", default="out/demo")
    p.add_argument("--quick", action="store_true", help="smaller workloads and fewer variants (CI smoke run)")
    args = p.parse_args(argv)
    seed_table()
    if args.quick:
        workloads = [WorkloadConfig("resend", num_prompts=1, prompt_len=1024, max_tokens=4),
                     WorkloadConfig("tenants", tenants=2, questions_per_tenant=3, prompt_len=512, max_tokens=4)]
    else:
        workloads = [WorkloadConfig("resend", num_prompts=3, prompt_len=4096, max_tokens=8, concurrency=1),
                     WorkloadConfig("tenants", tenants=3, questions_per_tenant=8, prompt_len=2048, max_tokens=8,
                                    concurrency=4)]
    interval = f"engine.retention='{INTERVAL}'"
    dense = make_variants(args.config, (interval,), ("policy",) if args.quick else ("policy", "eagle"))
    sparse = [v for v in make_variants(args.config, ("engine.retention=latest",), ("policy",))
              if v.name.split("/")[0] in ("hybrid", "attention_overlap")]
    variants = dense + ([] if args.quick else sparse)
    print(f"\nLoad test: {len(variants)} servers, one after another ({', '.join(v.name for v in variants)}),"
          f" workloads {', '.join(w.workload for w in workloads)}\n", flush=True)
    out = Path(args.out)
    results = run_compare(args.config, variants, workloads, log_dir=out, show_progress=True)
    paths = write_outputs(results, out)
    summaries = [summarize(r) for r in results]
    print(format_summaries(summaries))
    print("\nratios against the baseline (first) variant:")
    print(format_ratios(results))
    n = len(dense) * len(workloads)
    print("\nheadline (this run):")
    for line in headline(summaries[:n], summaries[n:]):
        print("  " + line)
    print("\n" + "\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
