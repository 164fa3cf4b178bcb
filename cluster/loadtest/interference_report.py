"""What the `interference` workload measures, per variant: the decoding streams' inter-token
latency (ITL) alone (control) and with long prompts arriving (interference), their p99 ratio, the
long prompts' TTFT and the throughput; a table and a plot (ITL CDFs per round, one colour per variant).

ITL samples are the gaps between a stream's token deliveries after its first token: tokens that
arrive together (EAGLE's accepted drafts, or outputs the server merged while its reader lagged)
are one delivery, so p99 is the longest stalls a stream sees. TPOT is each stream's mean time per
token after the first (its percentiles are over streams). On a `cluster.pd` cluster the gap after
the first token includes the hand-off to the decode replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.loadtest.outputs import cdf_step
from cluster.loadtest.records import LoadTestResult, RequestRecord
from cluster.loadtest.report import format_table, percentile, ratio

HANDOFFS = "hybridserve_handoffs_total"
HANDOFFS_KEPT = "hybridserve_handoffs_kept_total"


@dataclass(frozen=True)
class ItlStats:
    num_streams: int
    num_samples: int
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    tpot_p50_s: float | None  # streams' mean time per output token after the first
    tpot_max_s: float | None


@dataclass(frozen=True)
class InterferenceSummary:
    variant: str
    num_requests: int
    num_ok: int
    control: ItlStats  # decoding streams, no long prompt beside them
    interference: ItlStats  # the same streams while long prompts arrive
    long_ttft_p50_s: float | None
    long_ttft_p90_s: float | None
    output_tokens_per_s: float
    wall_s: float
    num_handoffs: float | None  # the server's /metrics counter over the run (None: not exported)
    num_handoffs_kept: float | None

    @property
    def p99_ratio(self) -> float | None:
        """Interference p99 ITL over control p99 ITL: 1.0 is no interference."""
        return ratio(self.interference.p99_s, self.control.p99_s)

    @property
    def tpot_ratio(self) -> float | None:
        """The streams' p50 TPOT with long prompts over alone: the slowdown spread over every token."""
        return ratio(self.interference.tpot_p50_s, self.control.tpot_p50_s)


def _itl(records: list[RequestRecord], phase: str) -> ItlStats:
    streams = [r for r in records if r.source == "decode" and r.phase == phase and r.ok]
    gaps = [g for r in streams for g in r.itl_s]
    tpots = [t for t in (r.tpot_s for r in streams) if t is not None]
    return ItlStats(len(streams), len(gaps), percentile(gaps, 50), percentile(gaps, 90), percentile(gaps, 99),
                    percentile(tpots, 50), max(tpots, default=None))


def summarize_interference(result: LoadTestResult) -> InterferenceSummary:
    records = result.records
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.source == "long" and r.ttft_s is not None]
    metrics = result.metrics
    return InterferenceSummary(
        variant=result.variant, num_requests=len(records), num_ok=len(ok), control=_itl(records, "control"),
        interference=_itl(records, "interference"), long_ttft_p50_s=percentile(ttfts, 50),
        long_ttft_p90_s=percentile(ttfts, 90),
        output_tokens_per_s=sum(r.completion_tokens or 0 for r in ok) / max(result.wall_s, 1e-9),
        wall_s=result.wall_s, num_handoffs=metrics.get(HANDOFFS) if metrics else None,
        num_handoffs_kept=metrics.get(HANDOFFS_KEPT) if metrics else None,
    )


COLUMNS = ("variant", "ok/reqs", "ITL alone p50/p90/p99 ms", "ITL w/ long p50/p90/p99 ms", "p99 ratio",
           "TPOT alone/w long ms", "TPOT ratio", "long TTFT p50/p90 ms", "tok/s", "hand-offs (kept)")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _itl_cell(s: ItlStats) -> str:
    return f"{_ms(s.p50_s)}/{_ms(s.p90_s)}/{_ms(s.p99_s)}"


def interference_row(s: InterferenceSummary) -> tuple[str, ...]:
    handoffs = "-" if s.num_handoffs is None else f"{s.num_handoffs:.0f} ({s.num_handoffs_kept or 0:.0f})"
    return (s.variant, f"{s.num_ok}/{s.num_requests}", _itl_cell(s.control), _itl_cell(s.interference),
            "-" if s.p99_ratio is None else f"{s.p99_ratio:.2f}",
            f"{_ms(s.control.tpot_p50_s)}/{_ms(s.interference.tpot_p50_s)}",
            "-" if s.tpot_ratio is None else f"{s.tpot_ratio:.2f}",
            f"{_ms(s.long_ttft_p50_s)}/{_ms(s.long_ttft_p90_s)}", f"{s.output_tokens_per_s:.1f}", handoffs)


def format_interference(summaries: list[InterferenceSummary]) -> str:
    return format_table(COLUMNS, [interference_row(s) for s in summaries])


def write_interference_plot(results: list[LoadTestResult], path: str | Path) -> Path:
    """Left: the streams' ITL CDF, control dashed vs long prompts solid, a colour per variant.
    Right: p99 ITL per variant and round (bars) with the long prompts' p50 TTFT (ticks, right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    summaries = [summarize_interference(r) for r in results]
    colour = {s.variant: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(summaries)}
    fig, (ax_cdf, ax_bar) = plt.subplots(1, 2, figsize=(11, 4.5))
    for res in results:
        for phase, style in (("control", "--"), ("interference", "-")):
            gaps = [1000 * g for r in res.records
                    if r.source == "decode" and r.phase == phase and r.ok for g in r.itl_s]
            cdf_step(ax_cdf, gaps, style, colour[res.variant], f"{res.variant} {phase}")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("inter-token latency (ms, log)")
    ax_cdf.set_ylabel("fraction of gaps")
    ax_cdf.set_title("decoding streams: alone (dashed) vs with long prompts (solid)", fontsize=9)
    ax_cdf.legend(fontsize=6)
    width = 0.35
    xs = range(len(summaries))
    ax_bar.bar([x - width / 2 for x in xs], [1000 * (s.control.p99_s or 0) for s in summaries], width,
               color="0.7", label="p99 ITL alone")
    ax_bar.bar([x + width / 2 for x in xs], [1000 * (s.interference.p99_s or 0) for s in summaries], width,
               color=[colour[s.variant] for s in summaries], label="p99 ITL with long prompts")
    ax_bar.set_xticks(list(xs), [s.variant for s in summaries], fontsize=7)
    ax_bar.set_ylabel("p99 ITL (ms)")
    ax_ttft = ax_bar.twinx()
    ax_ttft.scatter(list(xs), [1000 * (s.long_ttft_p50_s or 0) for s in summaries], color="k", marker="_", s=300)
    ax_ttft.set_ylabel("long prompts' p50 TTFT (ms, tick)")
    ax_bar.set_title("p99 ITL per variant; long-prompt TTFT", fontsize=9)
    ax_bar.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
