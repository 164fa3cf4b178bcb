"""The engine keeps retained Mamba checkpoints within checkpoint_memory_fraction of the cache
memory (evicting by expected value), stays exact on hits, and reports both on /metrics."""

import pytest

from cluster.http.metrics import Metrics
from tests.conftest import make_engine, make_prompt
from workers.engine.sampling_params import SamplingParams


def test_retained_checkpoints_stay_within_the_byte_budget(tiny_model):
    page = tiny_model.state_bytes_per_slot()
    memory = 96 * 2**20
    engine = make_engine(tiny_model, num_spec_tokens=0, retention="dense", cache_memory_bytes=memory,
                         checkpoint_memory_fraction=3 * page / memory + 1e-9)  # room for 3 checkpoints
    stats = engine.stats()
    assert stats["max_retained_checkpoint_bytes"] == 3 * page
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [make_prompt(300, 40 + i) for i in range(3)]
    cold = [engine.generate([p], params)[0] for p in prompts]  # dense: 4 snapshots each, 12 > 3
    stats = engine.stats()
    assert stats["num_retained_checkpoints"] == 3 and stats["retained_checkpoint_bytes"] == 3 * page
    assert stats["num_checkpoint_evictions"] + stats["num_snapshots_skipped"] >= 9
    (warm,) = engine.generate([prompts[-1]], params)  # the latest prompt's deepest checkpoints survive
    assert warm.num_cached_tokens == 256 and warm.token_ids == cold[-1].token_ids
    metrics = Metrics()
    metrics.attach_engine_stats(engine.stats)
    assert metrics.registry.get_sample_value("hybridserve_engine_retained_checkpoint_bytes") == 3 * page
    assert metrics.registry.get_sample_value("hybridserve_engine_num_retained_checkpoints") == 3


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_under_kv_pressure_blocks_above_every_retained_state_go_first(tiny_model, eviction):
    """A and B each leave a state at 256 and two KV blocks above it (no hit can use those); C then
    needs 4 blocks more than are empty. `value` evicts the 4 unusable blocks and A's resend still
    hits 256 tokens, byte-identical to its cold run; `lru` evicts A's oldest blocks, which breaks
    A's hit. Wrong changes this catches: the engine's attention pools without the joint-KV hook,
    spare blocks taken after kept ones, or a spare block whose state comes back left spare."""
    memory = 4 * 2**20
    page = tiny_model.state_bytes_per_slot()
    engine = make_engine(tiny_model, num_spec_tokens=0, retention="latest", eviction=eviction, max_model_len=512,
                         cache_memory_bytes=memory, mamba_memory_fraction=0.6,
                         checkpoint_memory_fraction=3 * page / memory + 1e-9)
    kv = engine.cache.pools[0]
    assert engine.cache.layout.groups[0].is_attention and engine.cache.mamba.max_retained_pages == 3
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a, b = make_prompt(300, 1), make_prompt(300, 2)
    (cold,) = engine.generate([a], params)
    engine.generate([b], params)
    assert kv.num_spare_blocks == (4 if eviction == "value" else 0)  # blocks ending at 272 and 288, each
    engine.generate([make_prompt((kv.num_free_empty_blocks + 4) * 16 - 8, 3)], params)
    computed = engine.num_computed_prompt_tokens
    (warm,) = engine.generate([a], params)
    assert warm.token_ids == cold.token_ids
    assert warm.num_cached_tokens == (256 if eviction == "value" else 0)
    assert engine.num_computed_prompt_tokens - computed == 300 - warm.num_cached_tokens
    kv.check_integrity()


def test_value_auto_hits_are_exact_after_it_has_learned(tiny_model):
    """`engine.eviction: value:auto` at 3 retained states: resending the first of four prompts
    passes its evicted states (regrets: T moves), then resending it again hits its new states.
    Every output equals its cold run and the engine computes only the tokens past each hit.
    Catches a learned policy that restores a state other than the one the hit names."""
    page = tiny_model.state_bytes_per_slot()
    memory = 96 * 2**20
    engine = make_engine(tiny_model, num_spec_tokens=0, retention="dense", eviction="value:auto",
                         cache_memory_bytes=memory, checkpoint_memory_fraction=3 * page / memory + 1e-9)
    policy = engine.cache.mamba.eviction
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [make_prompt(300, 60 + i) for i in range(4)]
    cold = [engine.generate([p], params)[0] for p in prompts]
    for _ in range(2):
        computed = engine.num_computed_prompt_tokens
        (warm,) = engine.generate([prompts[0]], params)
        assert warm.token_ids == cold[0].token_ids
        assert engine.num_computed_prompt_tokens - computed == 300 - warm.num_cached_tokens
    assert policy.num_regrets >= 1 and warm.num_cached_tokens == 256
