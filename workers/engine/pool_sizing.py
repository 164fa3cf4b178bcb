"""How many KV blocks and Mamba state pages a memory budget holds (device and host tier), from the
model's page sizes; a budget too small for one max_model_len request is refused by name."""

from __future__ import annotations

from workers.engine.config import EngineConfig
from workers.engine.errors import EngineConfigError


def _page_bytes(model, config: EngineConfig, speculative: bool) -> tuple[int, int]:
    """(one KV block across the target and draft pools, one Mamba state page), at least 1 each."""
    kv_bytes = model.kv_bytes_per_block(config.kv_block_size)
    if speculative:
        kv_bytes += model.draft_kv_bytes_per_block(config.kv_block_size)
    return max(1, kv_bytes), max(1, model.state_bytes_per_slot())


def _split(model, config: EngineConfig, speculative: bool, budget: int) -> tuple[int, int]:
    """(KV blocks, state pages) `budget` bytes hold, `mamba_memory_fraction` of it for states."""
    kv_bytes, state_bytes = _page_bytes(model, config, speculative)
    return (int(budget * (1 - config.mamba_memory_fraction)) // kv_bytes,
            int(budget * config.mamba_memory_fraction) // state_bytes)


def size_pools(model, config: EngineConfig, speculative: bool) -> tuple[int, int]:
    """(num_kv_blocks, num_state_slots) from the memory budget and the model's page sizes."""
    budget = config.cache_memory_bytes
    num_blocks, num_slots = _split(model, config, speculative, budget)
    need_blocks = -(-config.max_model_len // config.kv_block_size) + 2
    need_slots = 8 + config.num_spec_tokens
    if num_blocks < need_blocks or num_slots < need_slots:
        raise EngineConfigError(
            f"cache_memory_bytes={budget} gives {num_blocks} KV blocks and {num_slots} state pages; "
            f"one max_model_len request needs {need_blocks} blocks and {need_slots} pages"
        )
    return num_blocks, num_slots


def size_host_pools(model, config: EngineConfig, speculative: bool) -> tuple[int, int]:
    """(host KV blocks, host state pages) of `config.host_cache_bytes`, split as the device budget is."""
    if not config.host_cache_bytes:
        return 0, 0
    budget = config.host_cache_bytes
    num_blocks, num_pages = _split(model, config, speculative, budget)
    if not num_blocks or not num_pages:
        raise EngineConfigError(f"host_cache_bytes={budget} gives {num_blocks} KV blocks and {num_pages} state "
                                f"pages on the host; at least one of each is needed (or 0 for no host tier)")
    return num_blocks, num_pages
