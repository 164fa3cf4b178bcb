"""Block hashing defaults and counts, the messages of layout and hashing errors, draft group
indices and reconciliation without attention groups. Written to kill mutants `make mutants` found
surviving (the last 26 of the first full run)."""

from __future__ import annotations

import pytest

from cache_service import EagleMode, HybridCoordinator, RequestBlockHashes, root_hash
from cache_service.specs import CacheLayout, FullAttentionSpec, MambaSpec, SpecError
from tests.cache_service.helpers import make_hashes, make_layout, make_set_lookup


def test_default_fingerprint_and_salt_agree_between_root_hash_and_a_request():
    tokens = list(range(12))
    default = RequestBlockHashes(4, tokens)
    explicit = RequestBlockHashes(4, tokens, model_fingerprint="", cache_salt=None)
    assert default.root == explicit.root == root_hash() == root_hash("", None)
    assert default.hashes == explicit.hashes
    assert RequestBlockHashes(4, tokens, model_fingerprint="m").root == root_hash("m")


def test_an_empty_salt_is_no_salt_and_every_other_salt_differs():
    # the API accepts cache_salt="" (only its length is bounded): it names the unsalted prefixes
    assert root_hash("m", "") == root_hash("m", None)
    roots = {root_hash("m", s) for s in (None, "a", "b", "XXXX", " ", "ab")}
    assert len(roots) == 6


def test_different_extra_keys_never_share_a_hash():
    # same tokens under two adapters (and under two keys vs one) must not collide
    tokens = list(range(32))
    by_keys = {keys: RequestBlockHashes(8, tokens, extra_keys=keys).hashes
               for keys in ((), ("lora-a",), ("lora-b",), ("lora-a", "lora-b"), ("lora-b", "lora-a"))}
    seen = [h for hashes in by_keys.values() for h in hashes]
    assert len(seen) == len(set(seen)) == 5 * 4
    assert RequestBlockHashes(8, tokens, extra_keys=("lora-a",)).hashes == by_keys[("lora-a",)]


def test_a_fresh_request_counts_no_tokens_and_append_counts_new_hashes():
    empty = RequestBlockHashes(4)
    assert (empty.num_tokens, empty.hashes, empty.append([])) == (0, [], 0)
    assert empty.num_tokens == 0
    h = RequestBlockHashes(4, list(range(10)))  # 2 full blocks, 2 tokens pending
    assert (len(h.hashes), h.num_tokens) == (2, 10)
    assert h.append([]) == 0
    assert h.append([10, 11]) == 1  # completes block 3 from the pending tokens
    assert h.append(list(range(12, 21))) == 2  # 2 more full blocks, 1 pending
    assert (len(h.hashes), h.num_tokens) == (5, 21)
    assert h.append([21]) == 0


def test_hashing_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"^token ids must be non-negative 64-bit integers$"):
        RequestBlockHashes(4, [1, 2, -3, 4])
    with pytest.raises(ValueError, match=r"^hash_block_size must be positive, got 0$"):
        RequestBlockHashes(0)
    h = RequestBlockHashes(16, list(range(40)))
    with pytest.raises(ValueError, match=r"^no block hash for a 8-token prefix \(h=16, 2 full blocks hashed\)$"):
        h.prefix_hash(8)


def test_layout_errors_say_what_is_wrong():
    with pytest.raises(SpecError, match=r"^a cache layout needs at least one group$"):
        CacheLayout(())
    with pytest.raises(SpecError, match=r"^mamba: page_size_bytes must be >= 0, got -1$"):
        MambaSpec(16, page_size_bytes=-1)
    with pytest.raises(SpecError, match=r"^full: page_size_bytes must be >= 0, got -5$"):
        FullAttentionSpec(16, -5)


def test_a_draft_group_index_equal_to_the_group_count_is_out_of_range():
    layout = make_layout("full:16", "mamba:16")
    with pytest.raises(SpecError, match=r"^draft group index 2 out of range for 2 groups$"):
        HybridCoordinator(layout, EagleMode.DROP, draft_groups=[2])
    with pytest.raises(SpecError, match=r"^draft group index -1 out of range for 2 groups$"):
        HybridCoordinator(layout, EagleMode.DROP, draft_groups=[-1])
    assert HybridCoordinator(layout, EagleMode.DROP, draft_groups=[1]).annotated_groups == frozenset({1})


def test_a_layout_without_attention_groups_reports_no_attention_match():
    layout = make_layout("mamba:16")
    coord = HybridCoordinator(layout, EagleMode.OFF)
    hashes = make_hashes(layout, 100)
    hit = coord.find_longest_hit(hashes.hashes, 100, make_set_lookup(hashes, [{16, 32}]))
    assert (hit.hit_tokens, hit.attention_match_tokens, hit.prefix_match_tokens) == (32, 0, 0)
    assert coord.junctions(hit) == ()
    one = HybridCoordinator(make_layout("mamba:1"), EagleMode.OFF)  # alignment 1: a match of 1 would be a junction
    hashes = make_hashes(one.layout, 10)
    hit = one.find_longest_hit(hashes.hashes, 10, make_set_lookup(hashes, [set()]))
    assert (hit.hit_tokens, hit.attention_match_tokens, hit.prefix_match_tokens, one.junctions(hit)) == (0, 0, 0, ())
