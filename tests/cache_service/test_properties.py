"""Property tests: the reconciled hit equals a brute-force search over every candidate length."""

from __future__ import annotations

import math
from functools import reduce

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service import CacheLayout, EagleMode, HybridCoordinator, RequestBlockHashes
from cache_service.local_cache import LocalPrefixCache
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.simulate import make_tokens
from cache_service.specs import DraftAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from tests.cache_service.helpers import brute_force_group_best, brute_force_hit, group_serves, make_set_lookup

BLOCK_SIZES = st.sampled_from([8, 16, 24, 32])


@st.composite
def group_specs(draw):
    kind = draw(st.sampled_from(["full", "swa", "mamba", "draft"]))
    size = draw(BLOCK_SIZES)
    if kind == "swa":
        return SlidingWindowSpec(size, window=draw(st.integers(2, 100)))
    return {"full": FullAttentionSpec, "mamba": MambaSpec, "draft": DraftAttentionSpec}[kind](size)


@st.composite
def coordinators(draw):
    groups = tuple(draw(st.lists(group_specs(), min_size=1, max_size=4)))
    eagle = draw(st.sampled_from(list(EagleMode)))
    draft = draw(st.frozensets(st.integers(0, len(groups) - 1), max_size=len(groups)))
    rule = draw(st.sampled_from(["lookahead", "alignment"]))
    return HybridCoordinator(CacheLayout(groups), eagle, draft, rule)


def check_invariants(coord, num_prompt_tokens, ends, result):
    step, cap = coord.alignment, num_prompt_tokens - 1
    hit = result.hit_tokens
    assert hit % step == 0 and 0 <= hit <= max(cap, 0)
    for g, spec in enumerate(coord.layout.groups):
        assert group_serves(spec, hit, ends[g], g in coord.dropping_groups, step, cap, coord.drop_rule)
    assert hit == brute_force_hit(coord, num_prompt_tokens, ends)
    assert hit <= min(result.per_group_hits)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(coord=coordinators(), n=st.integers(1, 700), data=st.data())
def test_reconciled_hit_matches_brute_force_on_random_contents(coord, n, data):
    hashes = RequestBlockHashes(coord.layout.hash_block_size, make_tokens(n, 0, 50))
    ends = []
    for spec in coord.layout.groups:
        candidates = list(range(spec.block_size, n + 1, spec.block_size))
        density = data.draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
        mask = data.draw(st.lists(st.floats(0, 1), min_size=len(candidates), max_size=len(candidates)))
        ends.append({p for p, u in zip(candidates, mask) if u < density})
    result = coord.find_longest_hit(hashes.hashes, n, make_set_lookup(hashes, ends))
    check_invariants(coord, n, ends, result)
    # per-group answers are each group's own brute-force best at the aligned cap
    for g in range(len(coord.layout.groups)):
        assert result.per_group_hits[g] == brute_force_group_best(coord, g, n, ends[g])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    coord=coordinators(),
    n=st.integers(1, 600),
    extra=st.integers(-100, 300),
    retention=st.sampled_from(["latest", "dense", "x2", "x3"]),
    data=st.data(),
)
def test_retention_then_random_evictions_match_brute_force(coord, n, extra, retention, data):
    step = coord.alignment
    if retention.startswith("x"):
        retention = str(step * int(retention[1:]))
    planner = CheckpointPlanner(coord, make_retention(retention, step))
    resend_len = max(1, n + extra)
    tokens = make_tokens(max(n, resend_len), 3, 50)
    h = coord.layout.hash_block_size
    cold = RequestBlockHashes(h, tokens[:n])
    pool_sizes = [len(tokens) // g.block_size + 2 for g in coord.layout.groups]
    cache = LocalPrefixCache(coord, pool_sizes)
    cache.store_prefix(cold, n, planner.checkpoints(n, n))
    # evict a random subset, in a random order
    keys = [(g, k) for g, pool in enumerate(cache.pools) for k in pool.cached]
    order = data.draw(st.permutations(keys))
    for g, key in order[: data.draw(st.integers(0, len(order)))]:
        assert cache.pools[g].evict(key)
    cache.check_integrity()
    resend = RequestBlockHashes(h, tokens[:resend_len])
    ends = [
        {p for p in range(spec.block_size, resend_len + 1, spec.block_size) if resend.prefix_hash(p) in pool.cached}
        for spec, pool in zip(coord.layout.groups, cache.pools)
    ]
    result = cache.lookup(resend, resend_len)
    check_invariants(coord, resend_len, ends, result)


def test_alignment_is_lcm_and_hash_block_is_gcd():
    layout = CacheLayout((FullAttentionSpec(16), MambaSpec(24), SlidingWindowSpec(32, window=8)))
    assert layout.alignment == reduce(math.lcm, [16, 24, 32]) == 96
    assert layout.hash_block_size == 8
