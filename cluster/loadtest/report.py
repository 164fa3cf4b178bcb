"""Per-workload numbers from a run's records, and the table the CLI prints.

Cold requests are those whose prefix the server cannot have seen (a resend's first send, a
chat's first turn, a tenant's first question); warm ones could hit. The warm/cold ratio is
p50 warm TTFT over p50 cold TTFT in the same run, so it holds on a noisy machine.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from cluster.loadtest.records import LoadTestResult, RequestRecord


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


@dataclass(frozen=True)
class PhaseStats:
    num_requests: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    hit_rate: float | None  # cached / prompt tokens, from each response's `usage`


@dataclass(frozen=True)
class WorkloadSummary:
    workload: str
    variant: str
    num_requests: int
    num_ok: int
    cold: PhaseStats
    warm: PhaseStats
    tpot_p50_s: float | None
    hit_rate: float | None  # all requests, from `usage`
    server_hit_rate: float | None  # from the /metrics counters' change over the run
    requests_per_s: float
    output_tokens_per_s: float
    wall_s: float
    errors: dict[str, int]  # status -> count, for every status but "200"
    num_computed_tokens: int = 0  # prompt tokens the server ran through the model (ok requests, `usage`)
    num_cached_tokens: int = 0  # prompt tokens it served from the prefix cache

    @property
    def warm_cold_ratio(self) -> float | None:
        return ratio(self.warm.ttft_p50_s, self.cold.ttft_p50_s)


def _hit_rate(records: list[RequestRecord]) -> float | None:
    ok = [r for r in records if r.ok and r.usage_prompt_tokens]
    prompts = sum(r.usage_prompt_tokens for r in ok)
    return sum(r.cached_tokens or 0 for r in ok) / prompts if prompts else None


def _phase(records: list[RequestRecord], phase: str) -> PhaseStats:
    rs = [r for r in records if r.phase == phase]
    ttfts = [r.ttft_s for r in rs if r.ok and r.ttft_s is not None]
    return PhaseStats(len(rs), percentile(ttfts, 50), percentile(ttfts, 90), percentile(ttfts, 99), _hit_rate(rs))


def summarize(result: LoadTestResult) -> WorkloadSummary:
    records = result.records
    ok = [r for r in records if r.ok]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    wall = max(result.wall_s, 1e-9)
    return WorkloadSummary(
        workload=result.workload, variant=result.variant, num_requests=len(records), num_ok=len(ok),
        cold=_phase(records, "cold"), warm=_phase(records, "warm"), tpot_p50_s=percentile(tpots, 50),
        hit_rate=_hit_rate(records), server_hit_rate=result.metrics.hit_rate if result.metrics else None,
        requests_per_s=len(ok) / wall, output_tokens_per_s=sum(r.completion_tokens or 0 for r in ok) / wall,
        wall_s=result.wall_s, errors=dict(sorted(Counter(r.status for r in records if not r.ok).items())),
        num_computed_tokens=sum(r.computed_tokens or 0 for r in ok),
        num_cached_tokens=sum(r.cached_tokens or 0 for r in ok),
    )


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


COLUMNS = ("variant", "workload", "reqs", "cold p50/p90/p99 ms", "warm p50/p90/p99 ms", "warm/cold",
           "tpot ms", "hit", "warm hit", "/metrics hit", "computed/cached tok", "req/s", "tok/s", "errors")


def summary_row(s: WorkloadSummary) -> tuple[str, ...]:
    cold, warm = s.cold, s.warm
    errors = ",".join(f"{k}:{v}" for k, v in s.errors.items()) or "0"
    return (
        s.variant, s.workload, str(s.num_requests),
        f"{_ms(cold.ttft_p50_s)}/{_ms(cold.ttft_p90_s)}/{_ms(cold.ttft_p99_s)}",
        f"{_ms(warm.ttft_p50_s)}/{_ms(warm.ttft_p90_s)}/{_ms(warm.ttft_p99_s)}",
        _num(s.warm_cold_ratio, ".3f"), _num(None if s.tpot_p50_s is None else 1000 * s.tpot_p50_s, ".1f"),
        _num(s.hit_rate, ".1%"), _num(s.warm.hit_rate, ".1%"), _num(s.server_hit_rate, ".1%"),
        f"{s.num_computed_tokens}/{s.num_cached_tokens}", f"{s.requests_per_s:.2f}", f"{s.output_tokens_per_s:.1f}",
        errors,
    )


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A plain-text table; the first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def fmt(row) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)])


def format_summaries(summaries: list[WorkloadSummary]) -> str:
    return format_table(COLUMNS, [summary_row(s) for s in summaries])
