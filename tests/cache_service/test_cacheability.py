"""Cacheability at a glance (`cache_service.cacheability`): the startup block's numbers, checked
against the simulator the rules come from."""

import json

import pytest

from cache_service import EagleMode, HybridCoordinator
from cache_service.cacheability import cache_profile
from cache_service.explain import main as explain_main
from cache_service.retention import make_retention
from cache_service.simulate import simulate
from tests.cache_service.helpers import make_layout, make_scenario

NEMOTRON_H = ("full:64", "mamba:64", "draft:64")  # Nemotron 3 MoE + MTP (configs/sim/layouts.yaml)
GRANITE = ("full:16", "mamba:512")  # Granite-4.0-H-like: no MTP layer, a coarse Mamba page


def profile_of(groups, eagle, rule="lookahead", retention="latest"):
    coord = HybridCoordinator(make_layout(*groups), eagle, drop_rule=rule)
    return cache_profile(coord, make_retention(retention, coord.alignment))


def resend_hit(groups, prompt_len, **kw):
    sizes = tuple(2 * prompt_len // int(g.split(":")[1]) + 4 for g in groups)
    return simulate(make_scenario(groups, prompt_len, num_blocks_per_group=sizes, **kw)).resend.hit.hit_tokens


@pytest.mark.parametrize("groups, eagle, rule, retention, alignment, shortest", [
    (NEMOTRON_H, EagleMode.OFF, "lookahead", "latest", 64, 65),
    (NEMOTRON_H, EagleMode.LOSSLESS, "lookahead", "latest", 64, 65),
    (NEMOTRON_H, EagleMode.DROP, "lookahead", "latest", 64, 128),  # A + the draft block past the hit
    (NEMOTRON_H, EagleMode.DROP, "alignment", "latest", 64, 129),  # 2A + 1: one unit given up
    (GRANITE, EagleMode.LOSSLESS, "lookahead", "512", 512, 513),
    (GRANITE, EagleMode.DROP, "lookahead", "512", 512, 528),  # no draft group: every attention group drops
    (GRANITE, EagleMode.DROP, "alignment", "dense", 512, 1025),
    (("full:1", "mamba:1"), EagleMode.OFF, "lookahead", "latest", 1, 2),  # the finest grid: 2 tokens
])
def test_shortest_hit_prompt_is_where_the_simulator_first_hits(groups, eagle, rule, retention, alignment, shortest):
    profile = profile_of(groups, eagle, rule, retention)
    assert (profile.alignment, profile.shortest_hit_prompt) == (alignment, shortest)
    kw = {"eagle": eagle, "drop_rule": rule, "retention": retention, "num_spec_tokens": 0 if eagle == "off" else 3}
    assert resend_hit(groups, shortest, **kw) > 0
    assert resend_hit(groups, shortest - 1, **kw) == 0


def test_startup_block_nemotron_h_like_with_the_eagle_drop():
    assert profile_of(NEMOTRON_H, EagleMode.DROP).lines("nemotron") == [
        "cacheability of nemotron: hit grid 64 tokens (lcm of full:64, mamba:64, draft:64); shortest prompt that "
        "can hit: 128 tokens (an identical resend; EAGLE drop (lookahead rule); retention latest)",
        "  full:64: every 64-token KV block of the prefix",
        "  mamba:64: a state snapshot exactly at the hit, kept at the replay and final boundaries and at "
        "shared-prefix junctions (retention latest)",
        "  draft:64: every 64-token draft KV block of the prefix; EAGLE drop: the 64-token block starting at the "
        "hit too",
    ]


def test_startup_block_granite_like_without_a_drop():
    assert profile_of(GRANITE, EagleMode.LOSSLESS, retention="512").lines("granite") == [
        "cacheability of granite: hit grid 512 tokens (lcm of full:16, mamba:512); shortest prompt that can hit: "
        "513 tokens (an identical resend; EAGLE lossless; retention 512)",
        "  full:16: every 16-token KV block of the prefix",
        "  mamba:512: a state snapshot exactly at the hit, kept every 512 tokens and at the boundaries "
        "(retention 512)",
    ]


def test_the_alignment_rule_and_dense_retention_read_as_such():
    profile = profile_of(GRANITE, EagleMode.DROP, rule="alignment", retention="dense")
    assert profile.drop_rule == "alignment" and profile.dropping_groups == (0,)
    assert profile.needs == (
        "full:16: every 16-token KV block of the prefix; EAGLE drop: one 512-token unit below what it matches "
        "(alignment rule)",
        "mamba:512: a state snapshot exactly at the hit, kept every 512 tokens (retention dense)")


def test_prefix_caching_off_says_so():
    coord = HybridCoordinator(make_layout(*NEMOTRON_H), EagleMode.LOSSLESS)
    profile = cache_profile(coord, make_retention("latest", 64), prefix_caching=False)
    assert profile.lines("m") == ["cacheability of m: prefix caching is disabled: no prompt hits"]
    assert profile.as_dict()["prefix_caching"] is False


def test_explain_prints_the_profile_and_the_reason(capsys):
    assert explain_main(["--group", "full:16", "--group", "mamba:64", "--group", "draft:16", "--eagle", "drop",
                         "--prompt-len", "70", "--verbose"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shortest_hit_prompt"] == 80 and report["hit_tokens"] == 0
    assert (report["reason"], report["reason_position"]) == ("eagle_drop", 64)
    assert report["explanation"][-1].startswith("reason: eagle_drop: without the EAGLE drop the hit would be 64")
    assert report["needs"][2].endswith("EAGLE drop: the 16-token block starting at the hit too")


def test_the_profile_as_explain_reports_it():
    coord = HybridCoordinator(make_layout("full:16", "sliding_window:16:48", "mamba:64"), EagleMode.DROP)
    assert cache_profile(coord, make_retention(128, 64)).as_dict() == {
        "groups": ["full:16", "sliding_window:16:48", "mamba:64"], "alignment": 64, "hash_block_size": 16,
        "eagle": "drop", "drop_rule": "lookahead", "dropping_groups": [0, 1], "retention": "128",
        "shortest_hit_prompt": 80,
        "needs": ["full:16: every 16-token KV block of the prefix; EAGLE drop: the 16-token block starting at the "
                  "hit too",
                  "sliding_window:16:48: the 16-token blocks covering the 47 tokens before the hit; EAGLE drop: the "
                  "16-token block starting at the hit too",
                  "mamba:64: a state snapshot exactly at the hit, kept every 128 tokens and at the boundaries "
                  "(retention 128)"],
        "prefix_caching": True}
