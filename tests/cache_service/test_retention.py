import pytest

from cache_service import CheckpointPlanner, EagleMode, HybridCoordinator, SpecError, make_retention
from tests.cache_service.helpers import make_layout


def planner(eagle=EagleMode.OFF, retention="latest", groups=("full:16", "mamba:32"), aware=True, rule="lookahead"):
    coord = HybridCoordinator(make_layout(*groups), eagle, drop_rule=rule)
    return CheckpointPlanner(coord, make_retention(retention, coord.alignment), aware)


def test_latest_keeps_replay_and_final_boundaries():
    p = planner()
    assert p.checkpoints(300, 300) == (288,)  # R = F = 288
    assert p.checkpoints(288, 288) == (256, 288)  # R = 256 (cap 287), F = 288
    assert p.checkpoints(100, 350) == (96, 320)  # decode ran on to 350 tokens


def test_alignment_rule_adds_one_unit_below_each_reachable_boundary():
    drop = planner(EagleMode.DROP, rule="alignment")
    assert drop.checkpoints(288, 288) == (224, 256, 288)
    assert planner(EagleMode.DROP, aware=False, rule="alignment").checkpoints(288, 288) == (256, 288)
    assert drop.checkpoints(300, 300, junctions=[130]) == (96, 128, 256, 288)


def test_lookahead_rule_adds_the_unit_below_only_where_the_lookahead_block_cannot_exist():
    drop = planner(EagleMode.DROP)  # A = 32, dropping group full:16
    # N = 288: R = 256, lookahead [256, 272) inside the prompt -> no extra; F = 288, nothing computed
    # past 288, so [288, 304) cannot exist -> keep 256 (already R)
    assert drop.checkpoints(288, 288) == (256, 288)
    # N = 300: R = F = 288, [288, 304) runs past 300 -> keep 256; junction 130: position 128,
    # [128, 144) runs past the shared 130 tokens -> keep 96
    assert drop.checkpoints(300, 300, junctions=[130]) == (96, 128, 256, 288)
    # N = 310: R = F = 288, [288, 304) inside -> nothing below; junction 150: [128, 144) shared -> no 96
    assert drop.checkpoints(310, 310, junctions=[150]) == (128, 288)


def test_interval_and_dense():
    assert planner(retention="64").checkpoints(300, 300) == (64, 128, 192, 256, 288)
    assert planner(retention="dense").checkpoints(100, 100) == (32, 64, 96)


@pytest.mark.parametrize("bad", ["48", "-32", "0x", "sparse"])
def test_interval_must_be_a_positive_multiple_of_the_alignment(bad):
    with pytest.raises(SpecError, match="retention"):
        make_retention(bad, 32)
