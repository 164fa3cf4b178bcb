"""`hybridserve loadtest [WORKLOAD ...]` (also `python -m cluster.loadtest`).

    hybridserve loadtest resend tenants                    # spawn a server from --config, run two workloads
    hybridserve loadtest chat --url http://127.0.0.1:8000  # drive a running server
    hybridserve loadtest resend --compare                  # one server per policy / EAGLE / retention variant
    hybridserve loadtest trace --trace bench/traces/mooncake_synthetic_trace.jsonl.gz --scale 0.0625 --time-scale 4
    hybridserve loadtest interference --compare --axes pd --pd 2:2   # 4 mixed replicas vs 2 prefill + 2 decode
    ... --pd-cpus 0:1 --control-cpus 0   # the split's roles on CPU 0 / 1; control plane and this client on 0

Writes OUT/records.parquet (one row per request), OUT/loadtest.png, OUT/summary.json and prints a
table (with --compare, also ratios against the baseline variant); the interference workload also
OUT/interference.png and a table of the decoding streams' ITL alone vs with long prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import uuid
from pathlib import Path

from cluster.loadtest.client import ServerUnreachableError, run_workload
from cluster.loadtest.compare import AXES, PD_AXIS, format_ratios, make_variants, run_compare
from cluster.loadtest.interference_report import (
    format_interference,
    summarize_interference,
    write_interference_plot,
)
from cluster.loadtest.outputs import write_parquet, write_plot
from cluster.loadtest.records import LoadTestResult
from cluster.loadtest.report import format_summaries, summarize
from cluster.loadtest.server import ServerStartError, spawn_server
from cluster.loadtest.workloads import WORKLOADS, WorkloadConfig, build_workload


def _parser() -> argparse.ArgumentParser:
    d = WorkloadConfig()
    p = argparse.ArgumentParser(prog="hybridserve loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workloads", nargs="*", default=["resend"], metavar="WORKLOAD",
                   help=f"one or more of {', '.join(WORKLOADS)} (default: resend)")
    target = p.add_argument_group("server")
    target.add_argument("--url", help="drive this running server instead of spawning one")
    target.add_argument("--api-key", help="bearer token for --url")
    target.add_argument("--config", default="configs/local.yaml", help="config of spawned servers")
    target.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override for spawned servers, e.g. --set engine.max_model_len=4096 (repeatable)")
    target.add_argument("--compare", action="store_true",
                        help="spawn one server per variant (router policies, EAGLE drop/lossless, retention "
                             "latest/interval) and print ratios against the config's own setting")
    target.add_argument("--axes", nargs="+", choices=[*AXES, PD_AXIS], default=list(AXES),
                        help="variants for --compare (pd: mixed replicas vs the --pd split; not a default)")
    target.add_argument("--pd", type=_pd_split, default=None, metavar="P:D",
                        help="with --axes pd: P prefill + D decode replicas against P + D mixed ones")
    target.add_argument("--pd-cpus", type=_pd_cpus, default=None, metavar="PCPUS:DCPUS",
                        help="with --axes pd: pin the split's prefill replicas to PCPUS and its decode replicas "
                             "to DCPUS (Linux CPU lists, e.g. 0:1 or 0-3:4-7; cluster.pd.<role>_cpus)")
    target.add_argument("--control-cpus", type=_cpu_list, default=None, metavar="CPUS",
                        help="run each spawned server's control plane (cluster.control_cpus: the serving process, "
                             "Ray's daemons, controller, cache service) and this load generator on CPUS; replicas "
                             "keep the CPUs this process has now unless a role list places them")
    target.add_argument("--interval", type=int, default=128, help="retention interval (tokens) for --compare")
    size = p.add_argument_group("workload size")
    size.add_argument("--num-prompts", type=int, default=d.num_prompts, help="resend: distinct prompts")
    size.add_argument("--prompt-len", type=int, default=d.prompt_len,
                      help="tokens of a resend prompt / first chat turn / tenant system prompt")
    size.add_argument("--question-len", type=int, default=d.question_len,
                      help="tokens of a tenant question / later chat message")
    size.add_argument("--max-tokens", type=int, default=d.max_tokens)
    size.add_argument("--concurrency", type=int, default=d.concurrency)
    size.add_argument("--sessions", type=int, default=d.sessions, help="chat sessions")
    size.add_argument("--turns", type=int, default=d.turns, help="chat turns per session")
    size.add_argument("--tenants", type=int, default=d.tenants)
    size.add_argument("--questions-per-tenant", type=int, default=d.questions_per_tenant)
    size.add_argument("--rate", type=float, default=None,
                      help="open loop: requests/s with Poisson arrivals (mixed defaults to 4)")
    size.add_argument("--seed", type=int, default=d.seed)
    size.add_argument("--salt", default=None,
                      help="cache_salt prefix (default: fresh per run, so cold stays cold on a reused server)")
    size.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request timeout (s)")
    trace = p.add_argument_group("trace workload (a Mooncake-format trace slice)")
    trace.add_argument("--trace", default=None, help="Mooncake JSONL (.jsonl or .jsonl.gz)")
    trace.add_argument("--trace-start", type=int, default=d.trace_start, help="first request of the slice")
    trace.add_argument("--trace-limit", type=int, default=d.trace_limit, help="requests in the slice")
    trace.add_argument("--scale", type=float, default=d.scale,
                       help="tokens per 512-token trace block, as a fraction (1/16: 32 tokens)")
    trace.add_argument("--time-scale", type=float, default=d.time_scale, help="arrivals divided by this")
    trace.add_argument("--max-model-len", type=int, default=d.max_model_len,
                       help="prompts are cut (prefix kept) so prompt + max_tokens fit the server's max_model_len")
    inter = p.add_argument_group("interference workload (decoding streams, then again with long prompts arriving)")
    inter.add_argument("--streams", type=int, default=d.streams, help="decoding streams per round")
    inter.add_argument("--decode-tokens", type=int, default=d.decode_tokens, help="output tokens of each stream")
    inter.add_argument("--long-prompts", type=int, default=d.long_prompts,
                       help="long prompts (--prompt-len tokens, --max-tokens out) in the second round")
    inter.add_argument("--long-gap", type=float, default=d.long_gap_s, help="seconds between long prompts")
    p.add_argument("--out", default="out/loadtest", help="output directory (default: out/loadtest, git-ignored)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _pd_split(value: str) -> tuple[int, int]:
    parts = value.split(":")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"P:D (prefill and decode replica counts, e.g. 2:2), got {value!r}")
    return int(parts[0]), int(parts[1])


def _pd_cpus(value: str) -> tuple[str, str]:
    from workers.cpu_affinity import CpuListError, parse_cpu_list

    parts = value.split(":")
    try:
        if len(parts) != 2:
            raise CpuListError(value)
        for part in parts:
            parse_cpu_list(part)
    except CpuListError:
        raise argparse.ArgumentTypeError(
            f"PCPUS:DCPUS (two Linux CPU lists, e.g. 0:1 or 0-3:4-7), got {value!r}") from None
    return parts[0], parts[1]


def _cpu_list(value: str) -> str:
    from workers.cpu_affinity import CpuListError, parse_cpu_list

    try:
        parse_cpu_list(value)
    except CpuListError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def place_control(args: argparse.Namespace) -> None:
    """`--control-cpus`: every spawned server's control plane there, its replicas where this
    process runs now (`cluster.replica_cpus`), then this process (the load generator, which must
    not take the replicas' cores either) moved there too. Raises `ValueError` naming CPUs the host
    lacks."""
    if args.control_cpus is None:
        return
    from workers.cpu_affinity import CpuListError, allowed_cpus, parse_cpu_list, pin_this_process

    here = allowed_cpus()
    try:
        pin_this_process(parse_cpu_list(args.control_cpus))
    except CpuListError as exc:
        raise ValueError(f"--control-cpus: {exc}") from None
    args.overrides = [*args.overrides, f"cluster.control_cpus='{args.control_cpus}'", f"cluster.replica_cpus='{here}'"]


def workload_configs(args: argparse.Namespace) -> list[WorkloadConfig]:
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r} (choose from {', '.join(WORKLOADS)})")
    salt = args.salt if args.salt is not None else uuid.uuid4().hex[:8]
    configs = [WorkloadConfig(
        workload=name, num_prompts=args.num_prompts, prompt_len=args.prompt_len, question_len=args.question_len,
        max_tokens=args.max_tokens, concurrency=args.concurrency, sessions=args.sessions, turns=args.turns,
        tenants=args.tenants, questions_per_tenant=args.questions_per_tenant, rate=args.rate, seed=args.seed,
        salt=f"{salt}-{name}-" if salt else "", timeout_s=args.timeout, trace=args.trace,
        trace_start=args.trace_start, trace_limit=args.trace_limit, scale=args.scale, time_scale=args.time_scale,
        max_model_len=args.max_model_len, streams=args.streams, decode_tokens=args.decode_tokens,
        long_prompts=args.long_prompts, long_gap_s=args.long_gap,
    ) for name in dict.fromkeys(args.workloads)]
    for config in configs:
        if config.workload == "trace":  # a bad file or scale is an error before any server starts
            build_workload(config)
    return configs


def write_outputs(results: list[LoadTestResult], out: Path) -> dict[str, Path]:
    summaries = [summarize(r) for r in results]
    out.mkdir(parents=True, exist_ok=True)
    paths = {"records": write_parquet(results, out / "records.parquet"),
             "plot": write_plot(results, summaries, out / "loadtest.png"), "summary": out / "summary.json"}
    rows = [{**dataclasses.asdict(s), "warm_cold_ratio": s.warm_cold_ratio,
             "config": dataclasses.asdict(r.config)} for s, r in zip(summaries, results)]
    interference = [r for r in results if r.workload == "interference"]
    if interference:
        paths["interference_plot"] = write_interference_plot(interference, out / "interference.png")
        for row, r in zip(rows, results):
            if r.workload == "interference":
                s = summarize_interference(r)
                row["interference"] = {**dataclasses.asdict(s), "p99_ratio": s.p99_ratio, "tpot_ratio": s.tpot_ratio}
    paths["summary"].write_text(json.dumps(rows, indent=2) + "\n")
    return paths


def _run(args: argparse.Namespace, configs: list[WorkloadConfig], out: Path) -> list[LoadTestResult]:
    show = not args.no_progress
    if args.url:
        return [run_workload(args.url, c, api_key=args.api_key, variant="server", show_progress=show)
                for c in configs]
    if args.compare:
        variants = make_variants(args.config, tuple(args.overrides), tuple(args.axes), args.interval, args.pd,
                                 args.pd_cpus)
        print("variants: " + ", ".join(v.name for v in variants), file=sys.stderr)
        return run_compare(args.config, variants, configs, log_dir=out, show_progress=show)
    variant = make_variants(args.config, tuple(args.overrides), ())[0]
    with spawn_server(args.config, variant.overrides, log_path=out / "server.log") as server:
        return [run_workload(server.url, c, variant=variant.name, show_progress=show) for c in configs]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.url and args.compare:
        print("hybridserve loadtest: error: --compare spawns its own servers; drop --url", file=sys.stderr)
        return 2
    if args.url and args.control_cpus is not None:
        print("hybridserve loadtest: error: --control-cpus places the servers it spawns; drop --url", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        configs = workload_configs(args)
        place_control(args)
        results = _run(args, configs, out)
    except (ServerUnreachableError, ServerStartError, ValueError) as exc:
        print(f"hybridserve loadtest: error: {exc}", file=sys.stderr)
        return 2
    paths = write_outputs(results, out)
    print(format_summaries([summarize(r) for r in results]))
    if args.compare:
        print("\nratios against the baseline (first) variant:")
        print(format_ratios(results))
    interference = [summarize_interference(r) for r in results if r.workload == "interference"]
    if interference:
        print("\ninterference: decoding streams' ITL alone vs while long prompts arrive (p99 ratio: 1.0 = none)")
        print(format_interference(interference))
    print("\n" + "  ".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
