"""hybridserve's prefix-cache core: pure Python, shared by every worker and the cache service."""

from cache_service.block_hash import BlockHash, RequestBlockHashes, root_hash
from cache_service.block_pool import BlockPool, CacheBlock, PoolExhaustedError
from cache_service.coordinator import EagleMode, HitResult, HybridCoordinator
from cache_service.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, EventSink
from cache_service.local_cache import LocalPrefixCache, PoolLookup
from cache_service.lookup import CacheLookup, SetLookup
from cache_service.retention import CheckpointPlanner, RetentionPolicy, make_retention
from cache_service.specs import (
    CacheLayout,
    DraftAttentionSpec,
    FullAttentionSpec,
    GroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    SpecError,
    parse_group_spec,
)

__all__ = [
    "AllBlocksCleared", "BlockHash", "BlockPool", "BlockRemoved", "BlockStored", "CacheBlock", "CacheEvent",
    "CacheLayout", "CacheLookup", "CheckpointPlanner", "DraftAttentionSpec", "EagleMode", "EventSink",
    "FullAttentionSpec", "GroupSpec", "HitResult", "HybridCoordinator", "LocalPrefixCache", "MambaSpec",
    "PoolExhaustedError", "PoolLookup", "RequestBlockHashes", "RetentionPolicy", "SetLookup",
    "SlidingWindowSpec", "SpecError", "make_retention", "parse_group_spec", "root_hash",
]
