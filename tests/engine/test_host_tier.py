"""The host tier in the engine: pages the device evicts are demoted to host memory and promoted back
on a hit, byte-identical to a cold run in every EAGLE mode; the same traffic without a host tier
loses the hit (so the device really evicted it)."""

import pytest
import torch

from cache_service import cacheability
from cache_service.explain import explain_lookup
from cluster.http.metrics import Metrics
from tests.conftest import make_engine, make_prompt
from workers.engine.errors import EngineConfigError
from workers.engine.sampling_params import SamplingParams

# (k, eagle, hit of a 300-token resend): 256 in drop mode too, as the draft block [256, 272) is in the prompt
MODES = [(0, "off", 256), (3, "drop", 256), (3, "lossless", 256)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def run_one(engine, prompt):
    """(output, the prompt's block hashes)."""
    rid = engine.add_request(prompt, PARAMS)
    hashes = engine.requests[rid].hashes
    while engine.has_unfinished():
        (out,) = [o for o in engine.step() if o.finished] or (None,)
    return out, hashes


def device_rows(engine, kind: str) -> list:
    """Every tensor whose rows are group-`kind` pages (the full group's include the lossless sidecar)."""
    caches = engine.caches
    if kind == "mamba":
        return [*caches.conv.values(), *caches.ssm.values()]
    pools = caches.draft_kv if kind == "draft" else caches.kv
    rows = [t for pair in pools.values() for t in pair]
    return rows + [engine.cache.sidecar] if kind == "full" else rows


def page_contents(engine, hashes) -> dict:
    """(group, key) -> a copy of every tensor row of the page cached under key on the device."""
    out = {}
    for g, (pool, spec) in enumerate(zip(engine.cache.pools, engine.cache.layout.groups)):
        for key in hashes.hashes:
            block = pool.cached.get(key)
            if block is not None:
                out[(g, key)] = [t[block.block_id].clone() for t in device_rows(engine, spec.kind)]
    return out


def run_with_flood(engine, prompt, num_flood: int, first_seed: int = 100):
    """Cold run, a flood of other prompts, warm run; the prompt's pages on the device after its cold
    run must come back byte for byte (compared directly: a tiny random model's greedy tokens can
    survive a wrong page)."""
    cold, hashes = run_one(engine, prompt)
    pages = page_contents(engine, hashes)
    for i in range(num_flood):  # other prompts: their pages push every page of `prompt` off the device
        engine.generate([make_prompt(300, first_seed + i)], PARAMS)
    before = engine.num_computed_prompt_tokens
    warm, _ = run_one(engine, prompt)
    engine.cache.check_integrity()
    back = page_contents(engine, hashes)
    for page in pages.keys() & back.keys():
        assert all(torch.equal(a, b) for a, b in zip(pages[page], back[page])), f"page {page[0]} differs"
    run_with_flood.num_compared = len(pages.keys() & back.keys())
    return cold, warm, engine.num_computed_prompt_tokens - before


@pytest.mark.parametrize("k, eagle, hit", MODES)
def test_a_demoted_prefix_is_served_from_host_byte_identical(tiny_model, k, eagle, hit):
    """Wrong changes this catches: a promotion that loads another slot or skips the lossless
    sidecar (the pages are compared byte for byte, and the drafts with a device hit's), a lookup
    blind to the host (hit 0), a promotion that recomputes anyway (work counted), host pages sized
    0 (no demotion)."""
    config = dict(num_spec_tokens=k, eagle_mode=eagle, max_model_len=512, cache_memory_bytes=8 * 2**20,
                  mamba_memory_fraction=0.75, retention="latest")
    prompt = make_prompt(300, 7)
    hosted = make_engine(tiny_model, host_cache_bytes=24 * 2**20, **config)
    assert hosted.cache.host_pages is not None and hosted.cache.host_pages.nbytes <= 24 * 2**20
    cold, warm, computed = run_with_flood(hosted, prompt, num_flood=4)
    compared = run_with_flood.num_compared
    stats = hosted.cache.host_stats()
    assert stats["num_host_demoted_pages"] > 0 and stats["num_host_promoted_pages"] > 0
    assert warm.token_ids == cold.token_ids
    assert warm.num_cached_tokens == hit and warm.num_host_cached_tokens == hit
    # drafts as after a device hit: a lossless hit's draft KV at L-1 comes from the promoted sidecar
    roomy = make_engine(tiny_model, **{**config, "cache_memory_bytes": 64 * 2**20})
    _, device_warm, _ = run_with_flood(roomy, prompt, num_flood=0)
    assert device_warm.num_cached_tokens == hit and device_warm.num_host_cached_tokens == 0
    assert (warm.num_draft_proposed, warm.num_draft_accepted) == (
        device_warm.num_draft_proposed, device_warm.num_draft_accepted)
    assert computed == 300 - hit  # the hit's prompt tokens never went through the model
    assert compared >= 300 // 16  # the hit's KV blocks (and state) compared byte for byte
    assert cold.num_host_cached_tokens == 0
    # the same traffic without a host tier: the device alone has lost the prefix
    plain = make_engine(tiny_model, **config)
    cold2, warm2, computed2 = run_with_flood(plain, prompt, num_flood=4)
    assert warm2.num_cached_tokens == 0 and computed2 == 300 and warm2.token_ids == cold.token_ids
    assert plain.cache.host_stats() == dict.fromkeys(stats, 0)


def test_a_host_hit_stays_on_the_host_after_promotion(tiny_model):
    """Inclusive after promotion: a promoted page evicted from the device again is not copied to
    the host again (every page is saved at most once under its key over two rounds)."""
    engine = make_engine(tiny_model, num_spec_tokens=0, max_model_len=512, cache_memory_bytes=8 * 2**20,
                         mamba_memory_fraction=0.75, host_cache_bytes=24 * 2**20)
    saved = []
    pages, pools = engine.cache.host_pages, engine.cache.pools
    real_save = pages.save_page

    def spy(group_id, block_id, slot):
        saved.append((group_id, pools[group_id].blocks[block_id].block_hash))
        real_save(group_id, block_id, slot)

    pages.save_page = spy
    prompt = make_prompt(300, 7)
    run_with_flood(engine, prompt, num_flood=4)
    first = engine.cache.host_stats()
    cold, warm, _ = run_with_flood(engine, prompt, num_flood=4, first_seed=200)
    stats = engine.cache.host_stats()
    assert warm.num_cached_tokens == 256 and warm.token_ids == cold.token_ids
    assert first["num_host_promoted_pages"] > 0 and stats["num_host_promoted_pages"] > first["num_host_promoted_pages"]
    assert stats["num_host_dropped_pages"] == 0  # nothing left the host: a key saved twice was re-copied
    assert len(saved) == len(set(saved)) == stats["num_host_demoted_pages"]
    metrics = Metrics()  # /metrics: the tier of the hit, and the host tier's gauges
    metrics.attach_engine_stats(engine.stats)
    metrics.record(cold)
    metrics.record(warm)
    value = metrics.registry.get_sample_value
    assert value("hybridserve_prefix_cache_hit_tokens_total") == cold.num_cached_tokens + 256
    assert value("hybridserve_prefix_cache_host_hit_tokens_total") == 256 and cold.num_host_cached_tokens == 0
    assert value("hybridserve_engine_num_host_promoted_pages") == stats["num_host_promoted_pages"]
    assert value("hybridserve_engine_num_host_pages") == stats["num_host_pages"] > 0
    # explain: the tier of the hit, from the lookup report the request carries
    cache = engine.cache
    profile = cacheability.cache_profile(cache.coordinator, cache.planner.policy, True)
    shown = explain_lookup(profile, warm.cache_report)
    assert shown["hit_tier"] == "host" and sum(shown["host_promoted_pages"]) > 0
    assert any("host tier" in line for line in shown["explanation"])
    assert explain_lookup(profile, cold.cache_report)["hit_tier"] == "device"


@pytest.mark.parametrize("value", [-1, 1.5, "1G"])
def test_host_cache_bytes_must_be_a_non_negative_integer(tiny_model, value):
    with pytest.raises(EngineConfigError, match="host_cache_bytes must be a non-negative integer"):
        make_engine(tiny_model, host_cache_bytes=value)


def test_a_host_budget_too_small_for_one_page_is_refused(tiny_model):
    with pytest.raises(EngineConfigError, match="host_cache_bytes=100 gives 0 KV blocks"):
        make_engine(tiny_model, host_cache_bytes=100)
