"""The engine's own price of a host hit (`workers.engine.host_copy_price`): copy speed from a probe at
start-up and from every promotion it times, recompute speed from its prefill-heavy steps, bytes
from the host rows themselves; what a replica reports with its load."""

import pytest

from tests.conftest import make_engine, make_prompt
from tests.engine.test_host_tier import device_rows, run_with_flood
from workers.engine.host_copy_price import MIN_STEP_TOKENS, HostCopyMeter

CONFIG = dict(num_spec_tokens=3, eagle_mode="lossless", max_model_len=512, cache_memory_bytes=8 * 2**20,
              mamba_memory_fraction=0.75, retention="latest")


def row_bytes(engine, kind: str) -> int:
    return sum(t[0].numel() * t.element_size() for t in device_rows(engine, kind))


def test_the_engine_prices_a_host_hit_from_its_own_copies_and_steps(tiny_model):
    """Wrong changes this catches: bytes per token missing the draft group or the lossless sidecar,
    or the state page counted per token (the byte split is checked against the rows); promotions
    not timed (a copy sample per admission that promoted, beyond the probe's); a price before any
    prefill was measured; decode steps taken as the recompute speed (none of the flood's decode
    steps may count: steps counted <= prefill-heavy steps run)."""
    engine = make_engine(tiny_model, host_cache_bytes=24 * 2**20, **CONFIG)
    meter = engine.cache.host_pages.meter
    assert meter.num_copies == 1 and meter.s_per_byte > 0  # the start-up probe
    assert engine.host_copy_price() is None  # no step measured yet
    block = engine.config.kv_block_size
    fixed, per_token = engine.cache.host_pages.hit_bytes()
    assert fixed == row_bytes(engine, "mamba")
    assert per_token == pytest.approx((row_bytes(engine, "full") + row_bytes(engine, "draft")) / block)
    steps = []
    real_step = meter.observe_step
    meter.observe_step = lambda n, p, s: (steps.append((n, p)), real_step(n, p, s))
    cold, warm, _ = run_with_flood(engine, make_prompt(300, 7), num_flood=4)
    promoted = engine.cache.host_stats()["num_host_promoted_pages"]
    assert warm.num_host_cached_tokens == 256 and promoted > 0
    assert meter.num_copies == 2  # the probe, then the one admission that promoted (the resend)
    heavy = [(n, p) for n, p in steps if n >= MIN_STEP_TOKENS and 2 * p >= n]
    assert 0 < meter.num_steps == len(heavy) < len(steps)
    price = engine.host_copy_price()
    assert price is not None and price.fixed > 0 and price.per_token > 0
    assert price.fixed / price.per_token == pytest.approx(fixed / per_token)
    assert price.bytes_per_s == pytest.approx(1 / meter.s_per_byte)
    assert price.fixed == pytest.approx(fixed * meter.s_per_byte / meter.s_per_token)


def test_no_host_tier_no_price(tiny_model):
    engine = make_engine(tiny_model, **CONFIG)
    engine.generate([make_prompt(100, 1)])
    assert engine.cache.host_pages is None and engine.host_copy_price() is None


def test_the_meter_averages_time_per_unit_and_skips_decode_steps():
    meter = HostCopyMeter(fixed_bytes=1000, bytes_per_token=10.0, smoothing=0.5)
    meter.observe_copy(1000, 1e-3)
    assert meter.price() is None
    meter.observe_step(8, 8, 1.0)  # too short: overhead, not tokens
    meter.observe_step(64, 16, 1.0)  # decode-heavy
    meter.observe_copy(0, 1.0)  # empty: ignored
    assert meter.num_steps == 0 and meter.num_copies == 1 and meter.price() is None
    meter.observe_step(64, 32, 64e-3)  # 1 ms a token
    price = meter.price()
    assert price.fixed == pytest.approx(1.0) and price.per_token == pytest.approx(0.01)  # 1 us a byte
    meter.observe_copy(1000, 3e-3)  # 3 us a byte: the time average is 2 us (a speed average: 1.5 us)
    assert meter.price().fixed == pytest.approx(2.0) and meter.price().bytes_per_s == pytest.approx(5e5)
    with pytest.raises(ValueError, match="smoothing"):
        HostCopyMeter(1, 1.0, smoothing=0.0)
