"""Transfer or recompute by measured link and prefill speed (`cache_service.link_costs`)."""

import pytest

from cache_service.link_costs import LinkCostConfig, LinkCosts, PageBytes

MB = 10**6


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_unmeasured_pair_and_replica_use_the_assumptions():
    links = LinkCosts(LinkCostConfig(assumed_link_gbps=8.0, assumed_prefill_tokens_per_s=1000.0))
    choice = links.choose("a", "b", "r1", 500, 10 * MB)
    assert choice.link_bytes_per_s == 1e9 and not choice.measured
    assert choice.transfer_s == pytest.approx(0.01) and choice.recompute_s == pytest.approx(0.5)
    assert choice.move


def test_the_choice_flips_with_the_measured_link_speed():
    links = LinkCosts(LinkCostConfig(smoothing=1.0))
    links.observe_prefill("r1", 1000, 0.25)  # 4,000 tokens/s: 576 tokens recompute in 0.144 s
    links.observe_transfer("a", "b", 100 * MB, 0.1)  # 1 GB/s: 2 MB move in 2 ms
    fast = links.choose("a", "b", "r1", 576, 2 * MB)
    assert fast.move and fast.measured and fast.transfer_s == pytest.approx(0.002)
    links.observe_transfer("a", "b", 2 * MB, 2.0)  # the link cut to 1 MB/s: 2 s
    slow = links.choose("a", "b", "r1", 576, 2 * MB)
    assert not slow.move and slow.transfer_s == pytest.approx(2.0) and slow.recompute_s == pytest.approx(0.144)
    # per ordered pair: the reverse direction and other pairs keep their own (unmeasured) speed
    assert links.choose("b", "a", "r1", 576, 2 * MB).move and not links.choose("b", "a", "r1", 576, 2 * MB).measured
    # a slower target makes the same slow link worth it
    links.observe_prefill("r2", 100, 1.0)  # 100 tokens/s: 5.76 s to recompute
    assert links.choose("a", "b", "r2", 576, 2 * MB).move


def test_one_fast_sample_cannot_hide_a_link_gone_slow():
    """Averaged as time per byte: after a fast then a slow sample (weight 0.5), the pair is
    estimated at about twice the slow speed, not half the fast one."""
    links = LinkCosts(LinkCostConfig(smoothing=0.5))
    links.observe_transfer("a", "b", 1000 * MB, 1.0)  # 1 GB/s
    links.observe_transfer("a", "b", 1 * MB, 1.0)  # 1 MB/s
    rate, _ = links.link_speed("a", "b")
    assert 1.9 * MB < rate < 2.1 * MB
    links.observe_prefill("r", 1000, 1.0)
    links.observe_prefill("r", 3000, 1.0)
    assert links.prefill_speed("r") == pytest.approx(1500.0)  # 1 / mean(1/1000, 1/3000)


def test_a_skipped_pair_gets_one_trial_once_its_measurement_is_stale():
    clock = Clock()
    links = LinkCosts(LinkCostConfig(smoothing=1.0, remeasure_after_s=60.0), clock=clock)
    links.observe_prefill("r1", 1000, 0.1)
    links.observe_transfer("a", "b", 1 * MB, 1.0)
    assert not links.choose("a", "b", "r1", 500, 10 * MB).move
    clock.now += 59.0
    assert not links.choose("a", "b", "r1", 500, 10 * MB).move
    clock.now += 1.0
    trial = links.choose("a", "b", "r1", 500, 10 * MB)
    assert trial.move and trial.trial
    assert not links.choose("a", "b", "r1", 500, 10 * MB).move  # one trial, not one per request
    clock.now += 60.0
    assert links.choose("a", "b", "r1", 500, 10 * MB).trial  # the trial's own transfer never reported
    links.observe_transfer("a", "b", 1 * MB, 1.0)  # the trial measured the link slow again
    clock.now += 30.0
    assert not links.choose("a", "b", "r1", 500, 10 * MB).move


def test_empty_or_unreported_work_is_not_a_measurement():
    links = LinkCosts()
    links.observe_transfer("a", "b", 0, 1.0)
    links.observe_transfer("a", "b", MB, 0.0)
    links.observe_prefill("r", 0, 1.0)
    links.observe_prefill("r", 100, None)  # no first token (aborted)
    assert links.link_speed("a", "b")[1] is None and links.snapshot() == {"links": {}, "prefill_tokens_per_s": {}}


def test_page_bytes_is_a_line_in_the_tokens_moved():
    assert PageBytes(1000, 2.5).of(0) == 1000 and PageBytes(1000, 2.5).of(64) == 1160


@pytest.mark.parametrize("bad", [dict(assumed_link_gbps=0), dict(assumed_prefill_tokens_per_s=-1),
                                 dict(smoothing=0), dict(smoothing=1.5), dict(remeasure_after_s=0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        LinkCostConfig(**bad)
