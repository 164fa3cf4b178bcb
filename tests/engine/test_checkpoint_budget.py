"""The engine keeps retained Mamba checkpoints within checkpoint_memory_fraction of the cache
memory (evicting by expected value), stays exact on hits, and reports both on /metrics."""

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
