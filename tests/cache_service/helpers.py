"""make_* helpers for cache-core tests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cache_service import CacheLayout, HybridCoordinator, RequestBlockHashes, SetLookup, parse_group_spec
from cache_service.simulate import Scenario, make_tokens, simulate
from cache_service.specs import GroupSpec, MambaSpec, SlidingWindowSpec


def make_layout(*groups: str) -> CacheLayout:
    return CacheLayout(tuple(parse_group_spec(g) for g in groups))


def make_scenario(groups: Sequence[str], prompt_len: int, **kw) -> Scenario:
    return Scenario(groups=tuple(parse_group_spec(g) for g in groups), prompt_len=prompt_len, **kw)


def resend_hits(groups: Sequence[str], prompt_len: int, **kw) -> tuple[int, tuple[int, ...]]:
    result = simulate(make_scenario(groups, prompt_len, **kw))
    result.cache.check_integrity()
    return result.resend.hit.hit_tokens, result.resend.hit.per_group_hits


def dev_host_cold():
    """(index, coordinator, hashes) of three indexed replicas (full:16 + mamba:64, EAGLE off) and
    a 300-token prompt: `dev` holds its 256-token prefix on its device, `host` on its host tier
    only, `cold` nothing."""
    from cache_service.coordinator import EagleMode
    from cache_service.global_index import GlobalIndex

    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.OFF)
    hashes = RequestBlockHashes(16, make_tokens(300, 5, 50))
    keys = hashes.hashes[:16]
    index = GlobalIndex(2)
    for r in ("dev", "host", "cold"):
        index.add_replica(r)
    index.resync("dev", [keys, [hashes.prefix_hash(256)]], 0)
    index.resync("host", [[], []], 0, [keys, [hashes.prefix_hash(256)]])
    return index, coord, hashes


def make_hashes(layout: CacheLayout, num_tokens: int, seed: int = 0) -> RequestBlockHashes:
    return RequestBlockHashes(layout.hash_block_size, make_tokens(num_tokens, seed, 1000))


def make_set_lookup(hashes: RequestBlockHashes, ends_per_group: Iterable[Iterable[int]]) -> SetLookup:
    """A lookup whose group g holds exactly the prefixes ending at `ends_per_group[g]`."""
    return SetLookup([{hashes.prefix_hash(e) for e in ends} for ends in ends_per_group])


# ---- brute force: the hit semantics written out directly, independent of hit_finders ----------
def serves_raw(spec: GroupSpec, length: int, ends: set[int]) -> bool:
    size = spec.block_size
    if length == 0:
        return True
    if isinstance(spec, MambaSpec):
        return length in ends
    if isinstance(spec, SlidingWindowSpec):
        first = max(0, length - (spec.window - 1)) // size
        return all((j + 1) * size in ends for j in range(first, length // size))
    return all(j * size in ends for j in range(1, length // size + 1))


def group_serves(
    spec: GroupSpec, length: int, ends: set[int], drops: bool, alignment: int, cap: int, rule: str = "lookahead"
) -> bool:
    """cap = num_prompt_tokens - 1. Lookahead: the block [L, L + block) must be cached and end
    inside the prompt (<= cap + 1); alignment: the group must serve L + A within the aligned cap."""
    if length == 0:
        return True
    if not serves_raw(spec, length, ends):
        return False
    if not drops:
        return True
    if rule == "lookahead":
        return length + spec.block_size <= cap + 1 and length + spec.block_size in ends
    return length + alignment <= cap and serves_raw(spec, length + alignment, ends)


def brute_force_hit(coord: HybridCoordinator, num_prompt_tokens: int, ends_per_group: Sequence[set[int]]) -> int:
    """The largest aligned L <= N-1 every group serves, trying every candidate length."""
    step, cap = coord.alignment, num_prompt_tokens - 1
    return max(
        length
        for length in range(0, max(cap, 0) + 1, step)
        if all(
            group_serves(spec, length, ends_per_group[g], g in coord.dropping_groups, step, cap, coord.drop_rule)
            for g, spec in enumerate(coord.layout.groups)
        )
    )


def brute_force_group_best(coord: HybridCoordinator, g: int, num_prompt_tokens: int, ends: set[int]) -> int:
    step, cap = coord.alignment, num_prompt_tokens - 1
    spec, drops = coord.layout.groups[g], g in coord.dropping_groups
    rule = coord.drop_rule
    return max(L for L in range(0, max(cap, 0) + 1, step) if group_serves(spec, L, ends, drops, step, cap, rule))
