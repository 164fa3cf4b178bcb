"""Scenarios ported from vLLM's `tests/v1/core/test_prefix_caching.py` (hybrid, sliding-window,
EAGLE) and the sliding-window / junction bugs found by running them against `explain`. Each test
names its source; where our number differs on purpose, the test asserts ours and says why."""

import pytest

from cache_service import EagleMode, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.simulate import make_tokens, run_request
from tests.cache_service.helpers import brute_force_hit, make_layout, resend_hits

RULES = ["lookahead", "alignment"]


def cold_then(groups, prompt, eagle=EagleMode.DROP, retention="latest", rule="lookahead", draft=frozenset()):
    coord = HybridCoordinator(make_layout(*groups), eagle, draft, rule)
    planner = CheckpointPlanner(coord, make_retention(retention, coord.alignment))
    cache = LocalPrefixCache(coord, [400] * len(groups))
    run_request(cache, planner, prompt, None, explain=False)
    return coord, planner, cache


def cached_ends(cache, group, hashes, n):
    spec = cache.coordinator.layout.groups[group]
    pool = cache.pools[group]
    return {e for e in range(spec.block_size, n + 1, spec.block_size) if hashes.prefix_hash(e) in pool.cached}


# ---- vLLM test_eagle_enabled_removes_last_block / test_eagle_with_partial_blocks ---------------
def test_eagle_divisible_prompt_keeps_the_block_its_lookahead_proves():
    """vLLM (use_eagle, 48 tokens, block 16) expects 16: cap to 2 blocks, then drop one. Ours is 32
    on purpose: the block [32, 48) is cached and proves the successor token of position 31."""
    assert resend_hits(["full:16"], 48, eagle=EagleMode.DROP, num_spec_tokens=3)[0] == 32
    assert resend_hits(["full:16"], 48, eagle=EagleMode.DROP, num_spec_tokens=3, drop_rule="alignment")[0] == 16


def test_eagle_with_partial_blocks():
    """vLLM: 2 full blocks + 5 tokens, EAGLE -> 1 block (16). Ours too: [32, 48) is partial."""
    for rule in RULES:
        assert resend_hits(["full:16"], 37, eagle=EagleMode.DROP, num_spec_tokens=3, drop_rule=rule)[0] == 16


# ---- vLLM test_eagle_with_sliding_window --------------------------------------------------------
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("groups", [["sliding_window:16:16"], ["full:16", "sliding_window:16:16"]])
def test_eagle_with_sliding_window(groups, rule):
    """vLLM: one SWA group, window = block = 16, 37 tokens, EAGLE: the resend hits 16; after the
    first block is evicted it hits 0 ("the only hit prefix is [NULL, BLOCK_2], dropped by EAGLE").
    With a full-attention group beside it the old drop hit 16 here: it judged "serves 16" from
    "serves 32" alone, though the window block before 16 was gone."""
    prompt = make_tokens(37, 0, 1000)
    coord, _, cache = cold_then(groups, prompt, rule=rule)
    hashes = RequestBlockHashes(16, prompt)
    assert cache.lookup(hashes, 37).hit_tokens == 16
    swa = len(groups) - 1
    assert cache.pools[swa].evict(hashes.prefix_hash(16))
    assert cache.lookup(hashes, 37).hit_tokens == 0


@pytest.mark.parametrize("rule", RULES)
def test_interval_sibling_never_hits_past_an_uncached_window_block(rule):
    """full:16 + sliding_window:16:16, interval 32, a sibling sharing 70 of 100 tokens. The old
    drop hit 48 with the window block [32, 48) never cached. Now: the alignment rule finds no
    servable length (0); the lookahead rule retains [32, 48) as the lookahead block of the
    checkpoint at 32, and 48 is then genuinely served (its lookahead [48, 64) is cached too)."""
    prompt = make_tokens(100, 0, 1000)
    coord, planner, cache = cold_then(["full:16", "sliding_window:16:16"], prompt, retention="32", rule=rule)
    sibling = prompt[:70] + make_tokens(30, 5, 1000)
    hashes = RequestBlockHashes(16, sibling)
    ends = [cached_ends(cache, g, hashes, 100) for g in range(2)]
    hit = cache.lookup(hashes, 100).hit_tokens
    assert hit == brute_force_hit(coord, 100, ends)
    assert hit == (48 if rule == "lookahead" else 0)
    if hit:
        assert hit in ends[1] and hit + 16 in ends[1]  # the window block before the hit and its lookahead


# ---- vLLM test_swa_shared_prefix_reuse_under_zero_retention ------------------------------------
@pytest.mark.parametrize("eagle", [EagleMode.OFF, EagleMode.LOSSLESS])
@pytest.mark.parametrize(
    "groups, expected",
    [
        (["full:16", "sliding_window:16:32"], 96),  # A = 16: the junction is the 96-token shared match
        (["full:16", "sliding_window:16:32", "mamba:64"], 64),  # A = 64: floor(96 / 64) * 64
    ],
)
def test_swa_shared_prefix_reuse_under_latest_retention(groups, expected, eagle):
    """A 100-token system prompt, three different questions, latest retention. The second
    request's full-attention match (96) runs past its hit (0): a junction, taken from the full
    group's match. Before the fix it was the minimum over all attention groups, and the sparse
    SWA group (holding only window tails) reported 0: no junction, and the third request missed."""
    coord = HybridCoordinator(make_layout(*groups), eagle)
    planner = CheckpointPlanner(coord, make_retention("latest", coord.alignment))
    cache = LocalPrefixCache(coord, [400] * len(groups))
    system = make_tokens(100, 7, 1000)
    traces = [run_request(cache, planner, system + make_tokens(40 + 10 * q, 100 + q, 1000), None, False)
              for q in range(3)]
    assert [t.hit.hit_tokens for t in traces[:2]] == [0, 0]
    assert traces[1].junctions == (96,)
    assert traces[2].hit.hit_tokens == expected
    cache.check_integrity()


# ---- vLLM test_prefill_hybrid_model (full + SWA + mamba groups) ---------------------------------
def test_hybrid_full_swa_mamba_resend():
    """vLLM's hybrid prefill test (full + SWA groups, block 16) reuses every full block below the
    cap. Ours adds a Mamba group with native 16-token checkpoints: the replay boundary of 55
    tokens is 48, and all three groups serve it."""
    hit, per_group = resend_hits(["full:16", "sliding_window:16:32", "mamba:16"], 55)
    assert (hit, per_group) == (48, (48, 48, 48))


# ---- vLLM mamba "align" mode (hit positions only at mamba block boundaries) --------------------
@pytest.mark.parametrize("n, expected", [(100, 64), (64, 0), (129, 128), (300, 256)])
def test_mamba_align_mode_hits_land_on_state_boundaries(n, expected):
    """vLLM's mamba cache mode `align` keeps states only at multiples of the mamba block size and
    caps the hit below the last token: full:16 + mamba:64 resends hit floor((N-1)/64)*64."""
    assert resend_hits(["full:16", "mamba:64"], n)[0] == expected


# ---- SGLang test_mamba_radix_cache match semantics (CHUNK = 64 <-> our mamba:64) --------------
def sglang_cache():
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"))
    planner = CheckpointPlanner(coord, make_retention("latest", coord.alignment))
    return coord, planner, LocalPrefixCache(coord, [400, 400])


def lookup(cache, tokens):
    return cache.lookup(RequestBlockHashes(16, tokens), len(tokens))


def test_sglang_n_minus_1_lookup_after_identical_prompt_lands_on_the_safe_boundary():
    """SGLang: the lookup is capped at input_len - 1; with no earlier checkpoint the hit is 0.
    Ours: a 64-token prompt keeps its state at 64 (final boundary), the resend's cap is 63 -> 0."""
    _, planner, cache = sglang_cache()
    prompt = make_tokens(64, 1, 1000)
    run_request(cache, planner, prompt, None, explain=False)
    assert lookup(cache, prompt).hit_tokens == 0


def test_sglang_checkpoint_does_not_block_matches_that_continue_past_it():
    """SGLang: a lookup covering the whole checkpointed edge resumes there. Ours: a 65-token
    prompt extending the 64-token one hits the state at 64."""
    _, planner, cache = sglang_cache()
    prompt = make_tokens(65, 1, 1000)
    run_request(cache, planner, prompt[:64], None, explain=False)
    assert lookup(cache, prompt).hit_tokens == 64


def test_sglang_match_never_returns_past_the_deepest_checkpoint():
    """SGLang: checkpoints at CHUNK and CHUNK + 30, lookup of CHUNK + 29 -> CHUNK. Ours too: the
    attention match runs to 80, but the deepest state at or below the cap is 64."""
    coord, planner, cache = sglang_cache()
    tokens = make_tokens(94, 2, 1000)
    run_request(cache, planner, tokens[:64], None, explain=False)
    run_request(cache, planner, tokens, None, explain=False)
    hit = lookup(cache, tokens[:93])
    assert (hit.hit_tokens, hit.prefix_match_tokens) == (64, 80)
    # SGLang re-tracks a state at the chunk-aligned boundary (64); ours already hits there, so no
    # junction is needed (a junction is recorded only when a later lookup could land above the hit)
    assert coord.junctions(hit) == ()


def test_sglang_shared_prefix_divergence_below_one_unit_reuses_nothing():
    """SGLang: two requests share an edge without a checkpoint: the shared part is not reused.
    Ours: 40 shared tokens are less than one alignment unit (64): no hit, no junction."""
    coord, planner, cache = sglang_cache()
    shared = make_tokens(40, 3, 1000)
    run_request(cache, planner, shared + make_tokens(60, 4, 1000), None, explain=False)
    second = run_request(cache, planner, shared + make_tokens(60, 5, 1000), None, explain=False)
    assert second.hit.hit_tokens == 0 and second.junctions == ()
    assert lookup(cache, shared + make_tokens(60, 6, 1000)).hit_tokens == 0


def test_sglang_full_match_returns_kv_through_the_last_checkpoint():
    """SGLang returns all CHUNK + 30 tokens on a full match (KV through the last checkpoint). Ours
    is 64 on purpose: the last prompt token is always recomputed (cap N - 1 = 93) and hits are
    multiples of the alignment (64), where a Mamba state exists."""
    _, planner, cache = sglang_cache()
    tokens = make_tokens(94, 2, 1000)
    run_request(cache, planner, tokens[:64], None, explain=False)
    run_request(cache, planner, tokens, None, explain=False)
    assert lookup(cache, tokens).hit_tokens == 64
