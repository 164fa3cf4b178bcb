"""Mamba states on the attention grid (`engine.checkpoint_grid: attention`,
`cache_service/checkpoint_grid.py`): hits land on any KV-block boundary, the Mamba block size only
bounds the spacing, and every hit is byte-identical to a cold run.

Wrong changes this catches: the engine keeping the Mamba block as the grid (hits stay on 64), a
state taken off the grid or the spacing bound lost (the retained positions), a hit whose restored
state is not the state at the hit (the outputs), work not saved (prompt tokens through the model),
and hand-offs between engines whose grids differ."""

from __future__ import annotations

import pytest

from cache_service.checkpoint_grid import on_grid
from cache_service.specs import CacheLayout, SpecError, parse_group_spec
from tests.conftest import make_engine, make_prompt
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineConfigError
from workers.engine.handoff import HandoffEngineSpec, HandoffError
from workers.engine.sampling_params import SamplingParams


def layout(*groups: str) -> CacheLayout:
    return CacheLayout(tuple(parse_group_spec(g) for g in groups))


def test_the_grid_moves_to_the_attention_block_and_the_page_bounds_the_spacing():
    moved, spacing = on_grid(layout("full:64", "mamba:2304", "mamba:2304"), "attention")
    assert moved.describe() == ["full:64", "mamba:64", "mamba:64"] and spacing == 2304
    moved, spacing = on_grid(layout("full:16", "mamba:64", "draft:16"), "attention")
    assert (moved.alignment, spacing) == (16, 64)
    assert on_grid(layout("full:64", "mamba:64"), "attention") == (layout("full:64", "mamba:64"), 0)
    assert on_grid(layout("mamba:64"), "attention") == (layout("mamba:64"), 0)  # no attention: as is
    assert on_grid(layout("full:16", "mamba:64"), "mamba") == (layout("full:16", "mamba:64"), 0)
    with pytest.raises(SpecError, match="attention or mamba"):
        on_grid(layout("full:16"), "block")
    with pytest.raises(EngineConfigError, match="attention or mamba"):
        EngineConfig(checkpoint_grid="fine")
    assert (EngineConfig(checkpoint_grid="attention").alignment, EngineConfig().alignment) == (16, 64)


@pytest.mark.parametrize("k, eagle", [(0, "lossless"), (3, "drop"), (3, "lossless")])
def test_a_resend_hits_on_the_kv_block_byte_identical(tiny_model, k, eagle):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = make_prompt(300, 11)
    hits = {}
    for grid in ("mamba", "attention"):
        engine = make_engine(tiny_model, num_spec_tokens=k, eagle_mode=eagle, checkpoint_grid=grid)
        (cold,) = engine.generate([prompt], params)
        computed = engine.num_computed_prompt_tokens
        (warm,) = engine.generate([prompt], params)
        assert warm.token_ids == cold.token_ids, grid
        assert engine.num_computed_prompt_tokens - computed == 300 - warm.num_cached_tokens, grid
        hits[grid] = warm.num_cached_tokens
        if grid == "attention":  # latest + the spacing bound: boundaries, and a state every 64
            kept = sorted(engine.cache.mamba.eviction.known()[key].position for key in engine.cache.mamba.pool.cached)
            assert {64, 128, 192, 256} <= set(kept) and all(p % 16 == 0 for p in kept)
    # the replay boundary: floor(299 / 64) * 64 = 256 on the Mamba grid, floor(299 / 16) * 16 = 288
    # on the KV grid; a dropping draft group needs the block starting at the hit, so one block less
    assert hits == ({"mamba": 256, "attention": 288} if eagle != "drop" else {"mamba": 256, "attention": 272})


def test_hand_offs_need_the_same_grid(tiny_model):
    a = HandoffEngineSpec.of(make_engine(tiny_model, num_spec_tokens=0, checkpoint_grid="attention"))
    b = HandoffEngineSpec.of(make_engine(tiny_model, num_spec_tokens=0))
    with pytest.raises(HandoffError, match="checkpoint_grid is 'attention' on the exporting engine"):
        a.check_matches(b)
