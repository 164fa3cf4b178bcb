"""Demotion and promotion interleaved with lookups, preemption and eviction (issue 29, item 5): a
derandomized property test drives random arrival orders of prompts that share prefixes through an
engine whose device pools are too small for them (so requests are preempted and pages are demoted
and promoted while others run), and asserts every output equals its cold run byte for byte, every
request finishes, and the pools' and host tiers' invariants hold after every step (no page both
free and referenced, no host slot holding two keys or lost).

Wrong changes this catches: a promoted page loaded from another slot or without the lossless
sidecar; a demotion that copies after the block was overwritten; a host page evicted while a hit
is promoting it (unpinned); a pin not released (a pool that runs dry: the engine stalls); a
promotion whose page can be evicted before the restore pins it.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine, make_prompt
from tests.engine.test_preemption import sized_engine
from workers.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
BASES = [make_prompt(192, 900 + i) for i in range(3)]
# 9 prompts: 3 shared prefixes x 3 tails (one exactly the base + 1 token: a resend-like hit)
PROMPTS = [base + make_prompt(n, 950 + 7 * b + n) for b, base in enumerate(BASES) for n in (1, 40, 90)]
_COLD: dict[tuple[int, str], list[tuple[int, ...]]] = {}


def cold_outputs(model, k: int, eagle: str) -> list[tuple[int, ...]]:
    if (k, eagle) not in _COLD:
        engine = make_engine(model, num_spec_tokens=k, eagle_mode=eagle, enable_prefix_caching=False)
        _COLD[(k, eagle)] = [engine.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    return _COLD[(k, eagle)]


def drive(engine, waves: list[list[int]]) -> dict[str, tuple[int, int]]:
    """Each wave's prompts arrive together after the previous wave's first step; returns per request
    (prompt index, output) as it finished."""
    done, ids = {}, {}
    for wave in waves:
        for i in wave:
            ids[engine.add_request(PROMPTS[i], PARAMS)] = i
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.cache.check_integrity()
    while engine.has_unfinished():
        outs = engine.step()
        assert outs or engine.scheduler.running, "the engine stalled"
        for out in outs:
            if out.finished:
                done[out.request_id] = out
        engine.cache.check_integrity()
    assert set(done) == set(ids), "a request never finished"
    return {rid: (ids[rid], done[rid]) for rid in ids}


WAVES = st.lists(st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=4), min_size=3, max_size=7)
TOTALS = {"promoted": 0, "preempted": 0, "host_hits": 0}


def check_run(model, k: int, eagle: str, waves) -> None:
    cold = cold_outputs(model, k, eagle)
    engine = sized_engine(model, num_blocks=60 if k else 70, num_pages=14 + k, k=k, eagle_mode=eagle,
                          max_model_len=512, max_num_seqs=3, retention="dense",
                          host_cache_bytes=8 * 2**20)
    for i, out in drive(engine, waves).values():
        assert out.token_ids == cold[i], f"prompt {i} differs from its cold run"
        TOTALS["preempted"] += out.num_preemptions
        TOTALS["host_hits"] += out.num_host_cached_tokens > 0
    TOTALS["promoted"] += engine.cache.host_stats()["num_host_promoted_pages"]


@settings(max_examples=12, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(waves=WAVES)
def test_random_interleavings_with_a_host_tier_stay_exact_no_speculation(tiny_model, waves):
    check_run(tiny_model, 0, "off", waves)


@settings(max_examples=6, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(waves=WAVES, eagle=st.sampled_from(["drop", "lossless"]))
def test_random_interleavings_with_a_host_tier_stay_exact_with_mtp(tiny_model, waves, eagle):
    check_run(tiny_model, 3, eagle, waves)


def test_the_interleavings_above_exercised_promotion_and_preemption():
    """Not vacuous: over the examples above, pages were promoted, hits came from the host and
    requests were preempted (runs after them: pytest keeps file order)."""
    assert TOTALS["promoted"] > 0 and TOTALS["host_hits"] > 0 and TOTALS["preempted"] > 0, TOTALS
