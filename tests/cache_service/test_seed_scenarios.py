"""The scenarios of DESIGN.md section 1, asserted exactly."""

import pytest

from cache_service import EagleMode
from tests.cache_service.helpers import resend_hits

GLM = ["full:64", "mamba:2304", "mamba:2304", "mamba:2304"]


def test_127_tokens_block_32_drop_hits_two_blocks():
    hit, per_group = resend_hits(["full:32", "mamba:32"], 127, eagle=EagleMode.DROP, num_spec_tokens=3)
    assert hit == 64
    assert per_group == (64, 96)


def test_127_tokens_block_32_drop_without_the_fix_hits_zero():
    for rule in ("lookahead", "alignment"):  # the 4th block [96, 128) is partial: no lookahead either
        hit, per_group = resend_hits(
            ["full:32", "mamba:32"], 127, eagle=EagleMode.DROP, num_spec_tokens=3, eagle_aware_retention=False,
            drop_rule=rule,
        )
        assert (hit, per_group) == (0, (64, 96))


@pytest.mark.parametrize(
    "draft_groups, dropping",
    [
        (frozenset(), {0, 1}),  # none annotated: every attention group drops (fallback)
        (frozenset({0}), {0}),  # full attention only annotated
        (frozenset({0, 1, 2}), {0, 1}),  # all annotated (the mamba annotation never makes it drop)
    ],
)
def test_three_annotation_routes_all_hit(draft_groups, dropping):
    from cache_service.simulate import simulate
    from tests.cache_service.helpers import make_scenario

    result = simulate(
        make_scenario(["full:32", "full:32", "mamba:32"], 127, eagle=EagleMode.DROP, draft_groups=draft_groups)
    )
    assert result.coordinator.dropping_groups == dropping
    assert result.resend.hit.hit_tokens == 64


def test_retention_keys_off_any_group_dropping_not_the_groups_own_flag():
    # only the full-attention group is annotated; the mamba group still keeps the unit below R
    from cache_service.simulate import simulate
    from tests.cache_service.helpers import make_scenario

    result = simulate(make_scenario(["full:32", "mamba:32"], 127, eagle=EagleMode.DROP, draft_groups=frozenset({0})))
    assert result.cold.checkpoints == (64, 96)  # R = 96; [96, 128) runs past 127 tokens -> keep 64 too


@pytest.mark.parametrize(
    "groups, prompt_len, expected",
    [
        (["full:16", "mamba:64"], 300, 192),  # alignment 64 > block size 16: back off one unit (64)
        (["full:64", "mamba:64"], 300, 192),  # alignment == block size
        (["full:16", "full:64", "mamba:32"], 300, 192),  # A = 64 > both 16 and 32
    ],
)
def test_alignment_rule_backs_off_exactly_one_alignment_unit(groups, prompt_len, expected):
    hit, _ = resend_hits(groups, prompt_len, eagle=EagleMode.DROP, num_spec_tokens=3, drop_rule="alignment")
    lossless, _ = resend_hits(groups, prompt_len, eagle=EagleMode.LOSSLESS, num_spec_tokens=3)
    assert lossless - hit == 64  # exactly one alignment unit, never one block
    assert hit == expected


@pytest.mark.parametrize(
    "groups, prompt_len, expected",
    [
        # A = 96, R = 288; the lookahead block [288, 320) runs past 300 tokens -> 192, kept by retention
        (["full:32", "mamba:96"], 300, 192),
        # A = 64, R = 256 (cap 299 -> 256); lookahead [256, 272) / [256, 320) inside 300? 272 yes, 320 no
        (["full:16", "mamba:64"], 300, 256),
        (["full:64", "mamba:64"], 300, 192),
        # A = 64; the full:64 group's lookahead [256, 320) runs past 300 -> 192
        (["full:16", "full:64", "mamba:32"], 300, 192),
        (["full:16", "mamba:64"], 340, 320),  # R = 320, lookahead [320, 336) ends inside 340 tokens
    ],
)
def test_lookahead_rule(groups, prompt_len, expected):
    hit, _ = resend_hits(groups, prompt_len, eagle=EagleMode.DROP, num_spec_tokens=3)
    assert hit == expected


def test_glm_like_layout_drop_lookahead():
    # R = floor(8900 / 2304) * 2304 = 6912; the full:64 lookahead block [6912, 6976) is inside the prompt
    hit, per_group = resend_hits(GLM, 8901, eagle=EagleMode.DROP, num_spec_tokens=3)
    assert per_group == (6912, 6912, 6912, 6912)
    assert hit == 6912


def test_glm_like_layout_drop_alignment_rule_is_the_seed_fix():
    hit, per_group = resend_hits(GLM, 8901, eagle=EagleMode.DROP, num_spec_tokens=3, drop_rule="alignment")
    assert per_group == (4608, 6912, 6912, 6912)
    assert hit == 4608


def test_glm_like_layout_drop_without_fix_is_the_seed_bug():
    hit, per_group = resend_hits(
        GLM, 8901, eagle=EagleMode.DROP, num_spec_tokens=3, eagle_aware_retention=False, drop_rule="alignment"
    )
    assert per_group == (4608, 6912, 6912, 6912)
    assert hit == 0


def test_glm_like_layout_lossless():
    hit, per_group = resend_hits(GLM, 8901, eagle=EagleMode.LOSSLESS, num_spec_tokens=3)
    assert per_group == (6912, 6912, 6912, 6912)
    assert hit == 6912


def test_native_block_sizes_lossless_hits_8896():
    native = ["full:64", "mamba:64", "mamba:64", "mamba:64"]
    hit, _ = resend_hits(native, 8901, eagle=EagleMode.LOSSLESS, num_spec_tokens=3)
    assert hit == 8896


def test_extended_resend_hits_the_final_boundary():
    # next chat turn: the cold request's final boundary floor(N/A)*A = 8896 is retained
    hit, _ = resend_hits(["full:64", "mamba:64"], 8901, resend_len=9500, eagle=EagleMode.LOSSLESS, num_spec_tokens=3)
    assert hit == 8896
    hit, _ = resend_hits(["full:64", "mamba:64"], 8901, resend_len=9500, eagle=EagleMode.DROP, num_spec_tokens=3)
    assert hit == 8832  # F = 8896: its lookahead block [8896, 8960) was never computed -> one unit below
    hit, _ = resend_hits(
        ["full:64", "mamba:64"], 8901, resend_len=9500, eagle=EagleMode.DROP, num_spec_tokens=3, drop_rule="alignment"
    )
    assert hit == 8832


def test_other_tenant_gets_no_hit():
    from cache_service import HybridCoordinator, LocalPrefixCache, RequestBlockHashes
    from cache_service.simulate import make_tokens
    from tests.cache_service.helpers import make_layout

    coord = HybridCoordinator(make_layout("full:16", "mamba:16"))
    cache = LocalPrefixCache(coord, [100, 100])
    tokens = make_tokens(200, 1, 100)
    mine = RequestBlockHashes(16, tokens, cache_salt="tenant-a")
    cache.store_prefix(mine, 200, (192,))
    assert cache.lookup(mine, 200).hit_tokens == 192
    theirs = RequestBlockHashes(16, tokens, cache_salt="tenant-b")
    assert cache.lookup(theirs, 200).hit_tokens == 0
    assert cache.lookup(RequestBlockHashes(16, tokens), 200).hit_tokens == 0
