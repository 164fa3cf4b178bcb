"""`value:auto` (`cache_service/adaptive_value.py`): what each regret does to T and to the admission
bias, which ghosts count, and that the learned T reorders the heap. The engine and the simulator
learning the same: `tests/engine/test_eviction_matches_simulator.py`; through a Mamba pool: below."""

from __future__ import annotations

import pytest

from cache_service.adaptive_value import AdaptiveValueEviction, Ghost
from cache_service.block_hash import RequestBlockHashes
from cache_service.block_pool import BlockPool
from cache_service.coordinator import HybridCoordinator
from cache_service.eviction import EvictionError, make_eviction
from cache_service.mamba_manager import MambaManager
from cache_service.simulate import make_tokens
from cache_service.specs import CacheLayout, FullAttentionSpec, MambaSpec

LAYOUT = CacheLayout((FullAttentionSpec(16), MambaSpec(64)))


def k(i: int) -> bytes:
    return bytes([i]) * 16


def aged(policy: AdaptiveValueEviction) -> AdaptiveValueEviction:
    """a stored at t = 0, b and c at t = 10 (gains by position): the retained mean age is 10/3."""
    policy.stored(k(1), 64, 0)
    for _ in range(10):
        policy.tick()
    policy.stored(k(2), 64, 0)
    policy.stored(k(3), 64, 0)
    return policy


def test_the_spec_builds_it_and_a_bad_one_is_refused():
    policy = make_eviction("value:auto")
    assert isinstance(policy, AdaptiveValueEviction) and policy.name == "value"
    assert policy.tau_per_mean_reuse == 2.0 and policy.tau == 64.0 and policy.bias == 0.0
    assert type(make_eviction("value:2")) is not AdaptiveValueEviction  # a given T stays fixed
    with pytest.raises(EvictionError, match="value:T"):
        make_eviction("value:automatic")


def test_an_old_victim_regretted_grows_t_and_a_young_one_shrinks_it():
    policy = aged(AdaptiveValueEviction())
    policy.evicted(k(1))  # age 10 > mean age 3.33: it went for being old
    policy.removed(k(1))
    policy.missed([k(9), k(1), k(8)], 0)
    assert policy.num_regrets == 1 and policy.tau_per_mean_reuse == pytest.approx(2.2)
    assert policy.tau == pytest.approx(2.2 * 32)  # no reuse seen yet: T x the prior mean
    policy.evicted(k(2))  # age 0 < the mean: it went for its small gain
    policy.removed(k(2))
    policy.missed([k(2)], 0)
    assert policy.num_regrets == 2 and policy.tau_per_mean_reuse == pytest.approx(2.0)


def test_only_the_deepest_ghost_past_the_hit_counts_and_only_once():
    policy = aged(AdaptiveValueEviction())
    for key in (k(1), k(2)):
        policy.evicted(key)
        policy.removed(key)
    policy.missed([k(1), k(5)], 1)  # k(1) lies inside the hit: no regret
    assert policy.num_regrets == 0 and k(1) in policy.ghosts
    policy.missed([k(1), k(2)], 0)  # both past the hit: the deepest (k(2), young) counts
    assert policy.num_regrets == 1 and policy.tau_per_mean_reuse == pytest.approx(2 / 1.1)
    assert k(2) not in policy.ghosts and k(1) in policy.ghosts
    policy.missed([k(2)], 0)  # regretted once
    assert policy.num_regrets == 1


def test_t_stays_within_its_bounds():
    policy = aged(AdaptiveValueEviction())
    for _ in range(100):
        policy.ghosts[k(9)] = Ghost(0, 10.0, "evicted")  # young victims: T shrinks
        policy.missed([k(9)], 0)
    assert policy.tau_per_mean_reuse == AdaptiveValueEviction.MIN_T and policy.num_regrets == 100
    for _ in range(100):
        policy.ghosts[k(9)] = Ghost(100, 1.0, "evicted")  # old victims: T grows
        policy.missed([k(9)], 0)
    assert policy.tau_per_mean_reuse == AdaptiveValueEviction.MAX_T


def test_a_ghost_stored_again_is_forgotten_and_the_ghosts_are_bounded():
    policy = aged(AdaptiveValueEviction())
    policy.evicted(k(1))
    policy.removed(k(1))
    policy.stored(k(1), 64, 0)  # back in the pool (a transfer, a later snapshot)
    policy.missed([k(1)], 0)
    assert policy.num_regrets == 0
    for i in range(40):
        policy.refused(k(50 + i))
    assert len(policy.ghosts) == 16  # max(16, retained states): the oldest forgotten
    assert k(50) not in policy.ghosts and k(89) in policy.ghosts


def test_regretted_refusals_open_admission_and_regretted_admissions_close_it():
    policy = AdaptiveValueEviction(cost=None)
    policy.stored(k(1), 4096, 0)  # a long prefix: worth far more than a short new one
    policy.tick()
    assert not policy.admits(64, 0, k(1))
    for i in range(40):
        policy.refused(k(10 + i))
        policy.missed([k(10 + i)], 0)
    assert policy.bias == pytest.approx(40 * AdaptiveValueEviction.DELTA)
    assert policy.tau_per_mean_reuse == 2.0  # refusals move the bias only
    assert policy.admits(64, 0, k(1))  # log(4096 / 64) = 4.2 < the bias of 10
    policy.evicted(k(1))  # evicted for the snapshot admits let in: an admission
    policy.removed(k(1))
    policy.missed([k(1)], 0)
    assert policy.bias == pytest.approx(39 * AdaptiveValueEviction.DELTA)
    assert policy.tau_per_mean_reuse == pytest.approx(2 / 1.1)  # an eviction too: T moves (age 1, not above the mean)
    policy.bias = 0.1
    policy.stored(k(2), 64, 0)
    assert policy.admits(64, 0, k(2))
    policy.evicted(k(2))
    policy.removed(k(2))
    policy.missed([k(2)], 0)
    assert policy.bias == 0.0  # never below 0: value's own test


def test_a_learned_t_reorders_the_victims():
    """An old long prefix (2,048 tokens, last used 64 requests ago) against a fresh short one (64):
    at T = 2 (tau 64) the short one goes, log(2048 / 64) = 3.5 outweighing a decay of 1; once
    regrets of young victims bring T to its floor (tau 8: a decay of 8) the old one goes, and
    regrets of old victims bring it back. The heap is re-keyed as T moves."""
    policy = AdaptiveValueEviction()
    policy.stored(k(1), 2048, 0)
    for _ in range(64):
        policy.tick()
    policy.stored(k(2), 64, 0)
    free = lambda key: True  # noqa: E731
    assert policy.victim(free) == k(2)
    while policy.tau_per_mean_reuse > AdaptiveValueEviction.MIN_T:
        policy.ghosts[k(9)] = Ghost(0, 10.0, "evicted")
        policy.missed([k(9)], 0)
    assert policy.tau == pytest.approx(8.0) and policy.victim(free) == k(1)
    while policy.tau_per_mean_reuse < 2.0:
        policy.ghosts[k(9)] = Ghost(100, 1.0, "evicted")
        policy.missed([k(9)], 0)
    assert policy.victim(free) == k(2)


def test_a_mamba_pool_reports_evictions_refusals_and_prompts_to_the_policy():
    """Through `MambaManager`, one retained state: the second prompt's snapshot evicts the first's
    (an admission: its gain is larger); resending the first prompt passes that ghost: one regret,
    which closes admission again. A snapshot refused is a ghost too."""
    policy = AdaptiveValueEviction()
    manager = MambaManager(1, LAYOUT.groups[1], BlockPool(12, 1), HybridCoordinator(LAYOUT), _Backend(),
                           max_retained_pages=1, eviction=policy)
    first, second = RequestBlockHashes(16, make_tokens(128, 0, 1000)), RequestBlockHashes(16, make_tokens(256, 1, 1000))
    for rid, hashes, n in (("a", first, 128), ("b", second, 256)):
        manager.restore(rid, hashes, 0)
        assert manager.snapshot(hashes, manager.working_page(rid), n)
        manager.free(rid)
    assert manager.num_evictions == 1 and policy.num_regrets == 0
    assert policy.ghosts[first.prefix_hash(128)].cause == "admitted"
    policy.bias = 1.0
    manager.restore("c", first, 0)
    assert policy.num_regrets == 1 and policy.bias == pytest.approx(1.0 - AdaptiveValueEviction.DELTA)
    assert not manager.snapshot(first, manager.working_page("c"), 64)  # worth less than 256 tokens
    assert policy.ghosts[first.prefix_hash(64)].cause == "refused"
    manager.free("c")


def test_the_pool_tells_the_policy_how_many_prompt_blocks_its_hit_covers():
    """`missed` gets the prompt's block hashes and the hit in blocks (128 tokens: 8 of 16), so a
    ghost inside the hit is no regret."""
    seen = []

    class Recording(AdaptiveValueEviction):
        def missed(self, prefix, hit_blocks):
            seen.append((list(prefix), hit_blocks))
            super().missed(prefix, hit_blocks)

    manager = MambaManager(1, LAYOUT.groups[1], BlockPool(12, 1), HybridCoordinator(LAYOUT), _Backend(),
                           max_retained_pages=2, eviction=Recording())
    prompt = RequestBlockHashes(16, make_tokens(200, 0, 1000))
    manager.restore("a", prompt, 0)
    assert manager.snapshot(prompt, manager.working_page("a"), 128)
    manager.free("a")
    manager.restore("b", prompt, 128)
    assert seen == [(prompt.hashes, 0), (prompt.hashes, 8)]
    manager.free("b")


class _Backend:
    def copy_page(self, group_id, src, dst) -> None:
        pass


def test_re_keying_is_at_most_once_per_n_over_64_requests():
    """T may move at every request; re-keying the heap costs O(n), so a pool of n states re-keys
    at most once per n / 64 requests (amortized O(1)), and catches up once that many have passed."""
    policy = AdaptiveValueEviction()
    for i in range(128):  # n // 64 = 2 requests between re-keyings
        policy.stored(bytes([i, 0]) * 8, 64 * (i + 1), 0)
    policy.tick()
    policy.tick()

    def regret_young() -> None:
        policy.ghosts[k(9)] = Ghost(0, 10.0, "evicted")
        policy.missed([k(9)], 0)

    while policy._keyed_tau == 64.0:  # T falls from 2: re-keyed once tau halved
        regret_young()
    keyed = policy._keyed_tau
    assert keyed == policy.tau < 32.5
    while policy.tau > keyed / 2.5:  # falls further in the same request: no second re-keying yet
        regret_young()
    assert policy._keyed_tau == keyed
    policy.tick()
    policy.tick()
    regret_young()
    assert policy._keyed_tau == policy.tau < keyed / 2.5
