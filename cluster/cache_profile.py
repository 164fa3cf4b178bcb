"""The served model's cacheability profile (`cache_service/cacheability.py`: hit grid, shortest
prompt that can hit, what each group needs), from whichever backend serves it: the startup line
(`serve.py`) and every front door's `explain` by request id (`frontdoors.py`) read it here."""

from __future__ import annotations

from cache_service.cacheability import CacheProfile, cache_profile


def backend_cache_profile(backend, engine_config) -> CacheProfile:
    """The served model's cacheability: the backend's own (one engine in process), else from the
    layout and EAGLE mode a replica described (`ReplicaInfoMsg`) and the engine config's retention."""
    profile = getattr(backend, "cache_profile", None)
    if profile is not None:
        return profile
    info = backend.replica(backend.replica_ids[0]).info
    return replica_cache_profile(info.groups, info.eagle, engine_config)


def replica_cache_profile(groups: tuple[str, ...], eagle: str, engine_config) -> CacheProfile:
    """A replica's cacheability from what it describes (its groups and EAGLE mode) and the
    engine config every replica runs with (drop rule, retention)."""
    from cache_service.coordinator import HybridCoordinator
    from cache_service.retention import make_retention
    from cache_service.specs import CacheLayout, parse_group_spec

    layout = CacheLayout(tuple(parse_group_spec(g) for g in groups))
    coordinator = HybridCoordinator(layout, eagle, drop_rule=engine_config.drop_rule)
    # state_bytes 1: a profile describes where states are kept, not how many bytes they take
    retention = make_retention(engine_config.retention, layout.alignment, state_bytes=1,
                               spacing=engine_config.checkpoint_spacing)
    return cache_profile(coordinator, retention,
                         engine_config.enable_prefix_caching)
