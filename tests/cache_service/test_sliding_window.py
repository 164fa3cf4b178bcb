from cache_service import HybridCoordinator
from cache_service.group_managers import retained_block_ends
from cache_service.simulate import simulate
from cache_service.specs import SlidingWindowSpec
from tests.cache_service.helpers import make_hashes, make_layout, make_scenario, make_set_lookup


def test_full_plus_two_swa_resend_hits_three_blocks():
    result = simulate(make_scenario(["full:16", "sliding_window:16:32", "sliding_window:16:20"], 3 * 16 + 7))
    assert result.resend.hit.hit_tokens == 48
    assert result.resend.hit.per_group_hits == (48, 48, 48)
    # only the window tails before the checkpoint (48) are retained in the SWA pools
    pools = result.cache.pools
    assert pools[0].num_cached_blocks == 3
    for pool in pools[1:]:
        assert pool.num_cached_blocks == 2


def test_window_tail_block_ends():
    spec = SlidingWindowSpec(block_size=16, window=32)
    assert retained_block_ends(spec, 55, (48,)) == [32, 48]  # tokens 17..47 live in blocks 1, 2
    assert retained_block_ends(SlidingWindowSpec(16, window=17), 55, (48,)) == [48]
    assert retained_block_ends(spec, 200, (64, 192)) == [48, 64, 176, 192]


def test_swa_serves_a_length_whose_tail_is_cached_even_with_a_hole_below():
    layout = make_layout("sliding_window:16:32")
    coord = HybridCoordinator(layout)
    hashes = make_hashes(layout, 200)
    lookup = make_set_lookup(hashes, [{32, 48, 112, 128}])  # hole at 64..96
    assert coord.find_longest_hit(hashes.hashes, 200, lookup).hit_tokens == 128
    lookup = make_set_lookup(hashes, [{32, 48, 128}])
    assert coord.find_longest_hit(hashes.hashes, 200, lookup).hit_tokens == 48
