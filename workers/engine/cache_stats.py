"""The engine cache's gauges and counters (engine stats, /metrics): retained Mamba checkpoints and
the host tier's pages."""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.block_pool import BlockPool
from cache_service.mamba_manager import MambaManager


def checkpoint_stats(m: MambaManager) -> dict[str, int]:
    """Retained checkpoints: how many, their bytes against the budget, evictions, skipped snapshots."""
    return {"num_retained_checkpoints": m.num_retained, "retained_checkpoint_bytes": m.num_retained_bytes,
            "max_retained_checkpoint_bytes": (m.max_retained_pages or 0) * m.page_size_bytes,
            "num_checkpoint_evictions": m.num_evictions, "num_snapshots_skipped": m.num_snapshots_skipped}


def host_stats(pools: Sequence[BlockPool]) -> dict[str, int]:
    """The host tier's pages held, copied each way and dropped, over every group (zeros without one)."""
    tiers = [p.host for p in pools if p.host is not None]
    return {"num_host_pages": sum(len(t) for t in tiers),
            "num_host_demoted_pages": sum(t.num_demoted for t in tiers),
            "num_host_promoted_pages": sum(t.num_promoted for t in tiers),
            "num_host_dropped_pages": sum(t.num_dropped for t in tiers)}
