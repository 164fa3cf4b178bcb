"""`--compare`: the same workloads against one server per variant, in one run, reported as ratios.

Variants change one axis at a time around the config's own setting (the baseline):

    policy     router.policy      hybrid | attention_overlap | round_robin | oracle (ONE replica:
                                  every request sees the whole cache; the hit-rate ceiling)
    eagle      engine.eagle_mode  drop | lossless
    retention  engine.retention   latest | interval (every `interval` tokens)
    pd         cluster.pd         P:D prefill/decode replicas (`--pd`, P + D = the config's
                                  num_replicas) against the config's mixed replicas; not in the default axes

A variant is named `policy/eagle/retention` (+ `/pdP:D`); ones equal to the baseline collapse into it. Ratios
are taken against the baseline run of the same workload, and warm/cold within each run, so they
hold on a noisy machine where absolute milliseconds do not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster.loadtest.client import run_workload
from cluster.loadtest.records import LoadTestResult
from cluster.loadtest.report import WorkloadSummary, format_table, ratio, summarize
from cluster.loadtest.server import spawn_server
from cluster.loadtest.workloads import WorkloadConfig

AXES = {
    "policy": ("router.policy", ("hybrid", "attention_overlap", "round_robin", "oracle")),
    "eagle": ("engine.eagle_mode", ("drop", "lossless")),
    "retention": ("engine.retention", ("latest", "interval")),
}
PD_AXIS = "pd"  # a `--compare` axis with no value list: the `--pd P:D` split against mixed replicas


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # `--set` values for the server, on top of the run's own


def _retention_override(value: str, interval: int) -> tuple[str, str]:
    """(display name, override). Quoted so YAML keeps an interval a string."""
    if value == "interval":
        return f"interval{interval}", f"engine.retention='{interval}'"
    return value, f"engine.retention={value}"


def pd_overrides(pd: tuple[int, int], cpus: tuple[str, str] | None = None) -> tuple[str, ...]:
    """`--set` values for a fixed count of P prefill + D decode replicas (`cpus`: each role's
    CPU list, `cluster.pd.prefill_cpus` / `decode_cpus`)."""
    num_prefill, num_decode = pd
    n = num_prefill + num_decode
    pinned = () if cpus is None else (f"cluster.pd.prefill_cpus='{cpus[0]}'", f"cluster.pd.decode_cpus='{cpus[1]}'")
    return (f"cluster.num_replicas={n}", f"cluster.min_replicas={n}", f"cluster.max_replicas={n}",
            f"cluster.pd.num_prefill={num_prefill}", f"cluster.pd.num_decode={num_decode}", *pinned)


def make_variants(config_path: str | Path, overrides: tuple[str, ...] = (), axes: tuple[str, ...] = tuple(AXES),
                  interval: int = 128, pd: tuple[int, int] | None = None,
                  pd_cpus: tuple[str, str] | None = None) -> list[Variant]:
    """The baseline first, then one variant per other value on each of `axes` (`pd`: the `pd`
    split, on the baseline's other settings, against the baseline's P + D mixed replicas;
    `pd_cpus`: the split's prefill and decode CPU lists, its replicas pinned to them)."""
    from cluster.config_loader import load_config

    unknown = sorted(set(axes) - {*AXES, PD_AXIS})
    if unknown:
        raise ValueError(f"unknown compare axis {unknown[0]!r} (known: {', '.join(AXES)})")
    if PD_AXIS in axes:  # every variant on P + D replicas: mixed ones unless it is the pd variant
        if pd is None:
            raise ValueError("the pd compare axis needs a split: --pd P:D")
        n = pd[0] + pd[1]
        overrides = (*overrides, f"cluster.num_replicas={n}", f"cluster.min_replicas={n}", f"cluster.max_replicas={n}")
    cfg = load_config(config_path, list(overrides))
    if PD_AXIS in axes and cfg.cluster.pd.enabled:
        raise ValueError("the pd compare axis compares against mixed replicas: drop cluster.pd from the config")
    base_retention = cfg.engine.retention if cfg.engine.retention in ("latest", "dense") else "interval"
    base = {"policy": cfg.router.policy, "eagle": cfg.engine.eagle_mode.value, "retention": base_retention}
    if base_retention == "interval":
        interval = int(cfg.engine.retention)  # the config's own interval, on every variant

    def variant(setting: dict[str, str]) -> Variant:
        ret_name, ret_override = _retention_override(setting["retention"], interval)
        name = f"{setting['policy']}/{setting['eagle']}/{ret_name}"
        policy = setting["policy"]
        extra = ()
        if policy == "oracle":  # a single-replica cache: the ceiling routing is compared against
            policy, extra = "hybrid", ("cluster.num_replicas=1", "cluster.min_replicas=1", "cluster.max_replicas=1")
        return Variant(name, (*overrides, f"router.policy={policy}", *extra,
                              f"engine.eagle_mode={setting['eagle']}", ret_override))

    variants = [variant(base)]
    if PD_AXIS in axes:
        name = f"{variants[0].name}/pd{pd[0]}:{pd[1]}" + ("" if pd_cpus is None else f"@{pd_cpus[0]}:{pd_cpus[1]}")
        variants.append(Variant(name, (*variants[0].overrides, *pd_overrides(pd, pd_cpus))))
    for axis in (a for a in axes if a != PD_AXIS):
        for value in AXES[axis][1]:
            v = variant({**base, axis: value})
            if v.name not in {x.name for x in variants}:
                variants.append(v)
    return variants


def run_compare(config_path: str | Path, variants: list[Variant], workloads: list[WorkloadConfig], *,
                log_dir: str | Path | None = None, show_progress: bool = True,
                on_result: Callable[[LoadTestResult], None] | None = None) -> list[LoadTestResult]:
    """One server per variant (spawned, used for every workload, stopped); results in variant order."""
    results = []
    for v in variants:
        log_path = Path(log_dir) / f"server-{v.name.replace('/', '_')}.log" if log_dir else None
        with spawn_server(config_path, v.overrides, log_path=log_path) as server:
            for wl in workloads:
                res = run_workload(server.url, wl, variant=v.name, show_progress=show_progress)
                results.append(res)
                if on_result:
                    on_result(res)
    return results


RATIO_COLUMNS = ("variant", "workload", "warm/cold", "cold p50 vs base", "warm p50 vs base", "tpot vs base",
                 "tok/s vs base", "hit", "warm hit", "errors")


def _fmt(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def ratio_rows(summaries: list[WorkloadSummary]) -> list[tuple[str, ...]]:
    """Each summary against the first (baseline) summary of its workload."""
    base: dict[str, WorkloadSummary] = {}
    rows = []
    for s in summaries:
        b = base.setdefault(s.workload, s)
        rows.append((
            s.variant, s.workload, _fmt(s.warm_cold_ratio), _fmt(ratio(s.cold.ttft_p50_s, b.cold.ttft_p50_s)),
            _fmt(ratio(s.warm.ttft_p50_s, b.warm.ttft_p50_s)), _fmt(ratio(s.tpot_p50_s, b.tpot_p50_s)),
            _fmt(ratio(s.output_tokens_per_s, b.output_tokens_per_s)), _fmt(s.hit_rate, ".1%"),
            _fmt(s.warm.hit_rate, ".1%"), str(s.num_requests - s.num_ok),
        ))
    return rows


def format_ratios(results: list[LoadTestResult]) -> str:
    return format_table(RATIO_COLUMNS, ratio_rows([summarize(r) for r in results]))
