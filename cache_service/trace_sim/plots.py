"""One figure per `simulate --policy all` run: hit tokens per policy (vs the oracle), the TTFT CDF
per policy, and the cached bytes split between attention KV and recurrent state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_run(summaries: Mapping[str, dict], rows: Sequence[dict], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(summaries)
    fig, (ax_hit, ax_cdf, ax_mem) = plt.subplots(1, 3, figsize=(16, 4.5))
    rates = [summaries[p]["hit_rate"] for p in policies]
    ax_hit.barh(policies, rates, color="tab:blue")
    ax_hit.set_xlabel("hit tokens / input tokens")
    ax_hit.invert_yaxis()
    for y, p in enumerate(policies):
        ratio = summaries[p].get("hit_tokens_vs_oracle")
        if ratio is not None:
            ax_hit.text(rates[y], y, f" {ratio:.2f}x oracle", va="center", fontsize=8)
    for p in policies:
        ttft = sorted(r["ttft_s"] for r in rows if r["policy"] == p)
        if ttft:
            ax_cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=p)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("modeled TTFT (s)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.legend(fontsize=7)
    kv = [summaries[p]["memory_at_end"]["kv_bytes"] / 2**30 for p in policies]
    state = [summaries[p]["memory_at_end"]["state_bytes"] / 2**30 for p in policies]
    ax_mem.barh(policies, kv, label="attention KV", color="tab:orange")
    ax_mem.barh(policies, state, left=kv, label="Mamba state", color="tab:green")
    ax_mem.set_xlabel("cached GiB at the end (all replicas)")
    ax_mem.invert_yaxis()
    ax_mem.legend(fontsize=7)
    first = next(iter(summaries.values()))
    fig.suptitle(f"{first['layout']}, R={first['num_replicas']}, retention {first['retention']}, "
                 f"eagle {first['eagle']}, {first['num_requests']} requests, time scale {first.get('time_scale', 1)}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
