"""Shared-prefix junctions: tenants with one long system prompt and different questions."""

import pytest

from cache_service import EagleMode, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.simulate import make_tokens, run_request
from tests.cache_service.helpers import make_layout


@pytest.mark.parametrize("eagle, expected", [(EagleMode.LOSSLESS, 512), (EagleMode.DROP, 448)])
def test_third_sibling_hits_at_the_junction(eagle, expected):
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), eagle)
    planner = CheckpointPlanner(coord, make_retention("latest", coord.alignment))
    cache = LocalPrefixCache(coord, [400, 400])
    system = make_tokens(520, 7, 1000)  # the shared system prompt
    hits, junctions = [], []
    for q in range(3):
        question = make_tokens(100 + 10 * q, 100 + q, 1000)
        trace = run_request(cache, planner, system + question, None, explain=False)
        hits.append(trace.hit.hit_tokens)
        junctions.append(trace.junctions)
    assert hits[0] == 0
    assert hits[1] < expected  # no snapshot at the junction yet: attention matched 512, mamba did not
    assert junctions[1] == (512,)
    assert hits[2] == expected
    cache.check_integrity()


def test_interval_retention_gives_partial_hits_before_the_junction_exists():
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"), EagleMode.LOSSLESS)
    planner = CheckpointPlanner(coord, make_retention(128, coord.alignment))
    cache = LocalPrefixCache(coord, [400, 400])
    system = make_tokens(520, 7, 1000)
    run_request(cache, planner, system + make_tokens(50, 1, 1000), None, explain=False)
    second = run_request(cache, planner, system + make_tokens(50, 2, 1000), None, explain=False)
    assert second.hit.hit_tokens == 512  # 512 is also a multiple of the 128 interval
    hashes = RequestBlockHashes(16, system + make_tokens(50, 3, 1000))
    assert cache.lookup(hashes, len(hashes.hashes) * 16).hit_tokens == 512
