import pytest

from cache_service import EagleMode, HybridCoordinator, SpecError
from cache_service.coordinator import Boundary
from tests.cache_service.helpers import make_hashes, make_layout, make_set_lookup


def naive_spiralling_hit(coord, hashes, num_prompt_tokens, lookup):
    """The bug the coordinator avoids: re-applying the drop to each group's answer on every pass."""
    probes = [p.inner if hasattr(p, "inner") else p for p in coord.probes(hashes.hashes, num_prompt_tokens, lookup)]
    step = coord.alignment
    length = probes[0].ctx.floor(num_prompt_tokens - 1)
    while True:
        answers = []
        for g, p in enumerate(probes):
            own = p.longest_servable(length)
            answers.append(max(0, own - step) if g in coord.dropping_groups else own)
        nxt = min(answers)
        if nxt == length:
            return length
        length = nxt


def test_fixed_point_does_not_spiral_with_three_groups():
    layout = make_layout("full:32", "full:32", "mamba:32")
    coord = HybridCoordinator(layout, EagleMode.DROP)
    hashes = make_hashes(layout, 200)
    full = set(range(32, 193, 32))
    lookup = make_set_lookup(hashes, [full, full, {96, 160}])
    assert coord.find_longest_hit(hashes.hashes, 200, lookup).hit_tokens == 160
    assert naive_spiralling_hit(coord, hashes, 200, lookup) == 0


def test_hit_is_capped_below_the_last_prompt_token():
    layout = make_layout("full:16")
    coord = HybridCoordinator(layout)
    hashes = make_hashes(layout, 64)
    lookup = make_set_lookup(hashes, [{16, 32, 48, 64}])
    assert coord.find_longest_hit(hashes.hashes, 64, lookup).hit_tokens == 48
    assert coord.find_longest_hit(hashes.hashes, 65, lookup).hit_tokens == 64
    assert coord.find_longest_hit(hashes.hashes, 1, lookup).hit_tokens == 0


def test_attention_match_reports_the_junction():
    layout = make_layout("full:16", "mamba:16")
    coord = HybridCoordinator(layout, EagleMode.DROP)
    hashes = make_hashes(layout, 200)
    lookup = make_set_lookup(hashes, [set(range(16, 129, 16)), {32}])
    result = coord.find_longest_hit(hashes.hashes, 200, lookup)
    assert result.hit_tokens == 32
    assert result.attention_match_tokens == 128
    assert result.prefix_match_tokens == 128
    # a sibling sharing the 128 matched tokens cannot prove the successor token at 128
    # (its block [128, 144) is its own): it lands one unit below, at 112
    assert coord.reachable_hit_positions([Boundary(128, 128)]) == (112,)
    assert coord.junctions(result) == (128,)


def test_dropping_groups_selection():
    layout = make_layout("full:16", "sliding_window:16:32", "mamba:16", "draft:16")
    assert HybridCoordinator(layout, EagleMode.DROP).dropping_groups == {3}  # draft kind is annotated
    assert HybridCoordinator(layout, EagleMode.DROP, {0}).dropping_groups == {0, 3}
    plain = make_layout("full:16", "sliding_window:16:32", "mamba:16")
    assert HybridCoordinator(plain, EagleMode.DROP).dropping_groups == {0, 1}
    assert HybridCoordinator(plain, EagleMode.DROP, {2}).dropping_groups == {0, 1}
    assert HybridCoordinator(plain, EagleMode.LOSSLESS, {0}).dropping_groups == set()
    assert not HybridCoordinator(make_layout("mamba:16"), EagleMode.DROP).any_group_drops
    with pytest.raises(SpecError):
        HybridCoordinator(plain, EagleMode.DROP, {5})


def test_reachable_hit_positions():
    layout = make_layout("full:64", "mamba:2304")
    # replay boundary of 8,901 tokens: 6912; its lookahead block [6912, 6976) ends inside the prompt
    marks = [Boundary(6912, 8901), Boundary(6912, 8901)]
    assert HybridCoordinator(layout, EagleMode.DROP).reachable_hit_positions(marks) == (6912,)
    assert HybridCoordinator(layout, EagleMode.DROP, drop_rule="alignment").reachable_hit_positions(marks) == (4608,)
    assert HybridCoordinator(layout, EagleMode.LOSSLESS).reachable_hit_positions(marks) == (6912,)
    # a prompt of 6,950 tokens ends inside the lookahead block [6912, 6976): one unit below
    assert HybridCoordinator(layout, EagleMode.DROP).reachable_hit_positions([Boundary(6912, 6950)]) == (4608,)
    assert HybridCoordinator(layout, EagleMode.DROP).reachable_hit_positions([Boundary(2304, 2304)]) == ()


def test_bad_drop_rule_is_a_clear_error():
    with pytest.raises(SpecError, match="drop rule"):
        HybridCoordinator(make_layout("full:16"), EagleMode.DROP, drop_rule="sideways")
