"""What a replica reports about its memory after each step (`workers.replica.Replica._after_step`):
free attention blocks (free or evictable, for decode placement's headroom) and empty ones (free and
holding nothing cached: what a transfer lands in without evicting, `RouterConfig.transfer_may_evict`)."""

from types import SimpleNamespace

from tests.conftest import make_engine, make_prompt
from workers.engine.sampling_params import SamplingParams
from workers.replica import Replica


def _report(engine):
    sent = []
    stand_in = SimpleNamespace(publisher=SimpleNamespace(on_step=sent.append), num_held_handoffs=0, _num_accepted=0)
    Replica._after_step(stand_in, engine)
    (report,) = sent
    return report


def test_cached_blocks_stay_free_but_are_no_longer_empty(tiny_model):
    """After a 100-token prompt finishes, its blocks are free again (cached, evictable) but not
    empty: the report's empty count drops by the cached attention blocks, its free count does not.
    Catches: reporting the free count as empty (a transfer would evict these), or a report
    without it (None: every replica looks roomy)."""
    engine = make_engine(tiny_model)
    fresh = _report(engine)
    assert fresh.num_empty_blocks == fresh.num_free_blocks > 0
    engine.generate([make_prompt(100, 7)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    after = _report(engine)
    cached = engine.cache.full.pool.num_cached_blocks
    assert cached >= 100 // engine.cache.block_size
    assert after.num_free_blocks == fresh.num_free_blocks
    assert after.num_empty_blocks == fresh.num_empty_blocks - cached
