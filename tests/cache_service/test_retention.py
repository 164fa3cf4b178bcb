import pytest

from cache_service import CheckpointPlanner, EagleMode, HybridCoordinator, SpecError, make_retention
from tests.cache_service.helpers import make_layout


def planner(eagle=EagleMode.OFF, retention="latest", groups=("full:16", "mamba:32"), aware=True):
    coord = HybridCoordinator(make_layout(*groups), eagle)
    return CheckpointPlanner(coord, make_retention(retention, coord.alignment), aware)


def test_latest_keeps_replay_and_final_boundaries():
    p = planner()
    assert p.checkpoints(300, 300) == (288,)  # R = F = 288
    assert p.checkpoints(288, 288) == (256, 288)  # R = 256 (cap 287), F = 288
    assert p.checkpoints(100, 350) == (96, 320)  # decode ran on to 350 tokens


def test_drop_mode_adds_one_unit_below_each_reachable_boundary():
    assert planner(EagleMode.DROP).checkpoints(288, 288) == (224, 256, 288)
    assert planner(EagleMode.DROP, aware=False).checkpoints(288, 288) == (256, 288)
    assert planner(EagleMode.DROP).checkpoints(300, 300, junctions=[130]) == (96, 128, 256, 288)


def test_interval_and_dense():
    assert planner(retention="64").checkpoints(300, 300) == (64, 128, 192, 256, 288)
    assert planner(retention="dense").checkpoints(100, 100) == (32, 64, 96)


@pytest.mark.parametrize("bad", ["48", "-32", "0x", "sparse"])
def test_interval_must_be_a_positive_multiple_of_the_alignment(bad):
    with pytest.raises(SpecError, match="retention"):
        make_retention(bad, 32)
