"""The chaos soak's report: per fault, the requests that started while it was in force (from its
injection to the next one), and availability over time (Parquet + a plot)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class FaultWindow:
    name: str
    fired: float  # time.time() of the injection
    until: float = 0.0  # the next injection, or the end of its phase's traffic (0: not known yet)
    recovery_s: float | None = None  # to a clean cluster (`chaos_driver.Driver.recover`); None: never
    detail: dict = field(default_factory=dict)
    sent: int = 0
    completed: int = 0
    retried: int = 0  # finished only after a retry (another front door or a later attempt)
    lost: int = 0  # no attempt succeeded, or a non-retryable error
    differing: int = 0

    @property
    def ok(self) -> bool:
        return self.recovery_s is not None and self.lost == 0 and self.differing == 0


def score(windows: list[FaultWindow], records: list[dict], t_end: float) -> dict:
    """Fill each window from the records that started in it; totals over every request."""
    for k, w in enumerate(windows):
        if not w.until:
            w.until = windows[k + 1].fired if k + 1 < len(windows) else t_end
    totals = {"sent": 0, "completed": 0, "retried": 0, "lost": 0, "differing": 0}
    for rec in records:
        outcome = _outcome(rec)
        totals["sent"] += 1
        totals[outcome] += 1
        totals["retried"] += rec["attempts"] > 1 and outcome == "completed"
        w = next((w for w in windows if w.fired <= rec["t0"] < w.until), None)
        if w is None:
            continue
        w.sent += 1
        setattr(w, outcome, getattr(w, outcome) + 1)
        w.retried += rec["attempts"] > 1 and outcome == "completed"
    return totals


def _outcome(rec: dict) -> str:
    return {"ok": "completed", "differ": "differing"}.get(rec["status"], "lost")


def format_table(windows: list[FaultWindow], t_start: float) -> str:
    head = (f"{'t s':>7}  {'fault':<20}{'sent':>6}{'done':>6}{'retried':>9}{'lost':>6}{'differ':>8}"
            f"{'recovery s':>12}  detail")
    rows = [head, "-" * len(head)]
    for w in windows:
        rec = "never" if w.recovery_s is None else f"{w.recovery_s:.1f}"
        detail = ", ".join(f"{k}={v}" for k, v in w.detail.items())
        rows.append(f"{w.fired - t_start:>7.1f}  {w.name:<20}{w.sent:>6}{w.completed:>6}{w.retried:>9}{w.lost:>6}"
                    f"{w.differing:>8}{rec:>12}  {detail}")
    return "\n".join(rows)


def by_fault(windows: list[FaultWindow]) -> dict[str, dict]:
    """Per fault name: occurrences, the window sums, and the worst recovery."""
    out: dict[str, dict] = {}
    for w in windows:
        row = out.setdefault(w.name, {"times": 0, "sent": 0, "completed": 0, "retried": 0, "lost": 0,
                                      "differing": 0, "recovery_s": []})
        row["times"] += 1
        for k in ("sent", "completed", "retried", "lost", "differing"):
            row[k] += getattr(w, k)
        row["recovery_s"].append(w.recovery_s)
    for row in out.values():
        times = [r for r in row["recovery_s"] if r is not None]
        row["max_recovery_s"] = max(times) if len(times) == len(row["recovery_s"]) else None
    return out


def availability(records: list[dict], windows: list[FaultWindow], t_start: float, t_end: float) -> list[dict]:
    """One row per second of traffic: requests finished in it, by outcome, and the fault in force."""
    n = int(t_end - t_start) + 1
    rows = [{"t_s": s, "finished": 0, "completed": 0, "retried": 0, "lost": 0, "differing": 0, "fault": ""}
            for s in range(n)]
    for rec in records:
        s = min(n - 1, max(0, int(rec["t1"] - t_start)))
        outcome = _outcome(rec)
        rows[s]["finished"] += 1
        rows[s][outcome] += 1
        rows[s]["retried"] += rec["attempts"] > 1
    for w in windows:
        for s in range(max(0, int(w.fired - t_start)), min(n, int(w.until - t_start) + 1)):
            rows[s]["fault"] = w.name
    return rows


def write_outputs(out_dir: Path, report: dict, rows: list[dict], windows: list[FaultWindow], t_start: float) -> None:
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "chaos.json").write_text(json.dumps(report | {"windows": [asdict(w) for w in windows]}, indent=1))
    pq.write_table(pa.Table.from_pylist(rows), out_dir / "availability.parquet")
    fig, ax = plt.subplots(figsize=(12, 4))
    t = [r["t_s"] for r in rows]
    ax.plot(t, [r["completed"] for r in rows], lw=0.8, label="completed with the cold output / s")
    ax.plot(t, [r["retried"] for r in rows], lw=0.8, label="finished after a retry / s")
    ax.plot(t, [r["lost"] + r["differing"] for r in rows], lw=1.2, color="red", label="lost or differing / s")
    for k, w in enumerate(windows):
        end = w.fired + (w.recovery_s if w.recovery_s is not None else w.until - w.fired)
        ax.axvspan(w.fired - t_start, end - t_start, color=f"C{k % 8}", alpha=0.15)
        ax.text(w.fired - t_start, ax.get_ylim()[1] * 0.95, w.name, rotation=90, fontsize=7, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests / s")
    ax.set_title("chaos soak: availability (shaded: a fault until the cluster is clean again)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "availability.png", dpi=110)
    plt.close(fig)
