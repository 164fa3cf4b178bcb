"""The engine evicts exactly what the trace simulator evicts: one request sequence through a real
`LLMEngine` (tiny NemotronH, prefill-only requests) and through a simulated replica with the same
layout, pool sizes, retention and eviction policy leaves the same retained Mamba states after
every request, with the same eviction counts and the same policy bookkeeping, and the same cached
KV blocks with the same ones spare (above every retained state: `kv_support.py`), in every EAGLE
mode.

Wrong changes this catches: the engine building its Mamba managers with another policy than its
config names (or the default), the simulator ignoring `--eviction`, either side ticking the
policy's clock on something other than an admitted request, or snapshotting somewhere else, or
either side not valuing KV jointly with the states (or doing it under `lru`)."""

from __future__ import annotations

import random

import pytest

from cache_service.block_hash import RequestBlockHashes
from cache_service.coordinator import HybridCoordinator
from cache_service.eviction import EvictionConfig
from cache_service.hit_finders import DropRule
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.trace_sim.replica import SimReplica
from tests.conftest import make_engine
from workers.engine.sampling_params import SamplingParams


def history(seed: int) -> list[list[int]]:
    """Follow-ups, resends, siblings and unrelated prompts (see tests/sim/test_one_publication_path.py)."""
    rng = random.Random(seed)

    def fresh(lo: int, hi: int) -> list[int]:
        return [rng.randrange(512) for _ in range(rng.randrange(lo, hi))]

    prompts = [fresh(150, 300)]
    for _ in range(13):
        recent = rng.choice(prompts[-3:])
        kind = rng.choice(("follow-up", "resend", "sibling", "unrelated"))
        if kind == "follow-up":
            prompts.append(recent + fresh(40, 150))
        elif kind == "resend":
            prompts.append(list(recent))
        elif kind == "sibling":
            prompts.append(recent[: rng.randrange(len(recent) // 3, len(recent))] + fresh(1, 150))
        else:
            prompts.append(fresh(150, 300))
    return [trim(p[:600]) for p in prompts]


def trim(prompt: list[int]) -> list[int]:
    """Cut to a length N with N mod 16 in 1..8 (so N mod 64 <= 56): the 3 tokens a request
    computes past its prompt complete no block and cross no alignment boundary, so the engine
    publishes what the simulator (which publishes the prompt) does."""
    r = len(prompt) % 16
    return prompt[: len(prompt) - (8 if r == 0 else max(0, r - 8))]


@pytest.mark.heavy
@pytest.mark.parametrize("eviction", ["value", "lru"])
@pytest.mark.parametrize("k, eagle", [(0, "lossless"), (3, "drop"), (3, "lossless")])
def test_the_engine_evicts_what_the_simulator_evicts(tiny_model, k, eagle, eviction):
    num_spare, _, _ = run_both(tiny_model, k, eagle, eviction, "dense")
    assert (num_spare > 0) == (eviction != "lru")


@pytest.mark.heavy
def test_value_t_too(tiny_model):
    """`engine.eviction: value:1` (tau one mean reuse distance): the engine's policy takes the
    setting and evicts as the simulator's."""
    num_spare, _, _ = run_both(tiny_model, 3, "lossless", "value:1", "dense")
    assert num_spare > 0


@pytest.mark.heavy
@pytest.mark.parametrize("k, eagle", [(0, "lossless"), (3, "drop"), (3, "lossless")])
def test_value_auto_learns_what_the_simulator_learns(tiny_model, k, eagle):
    """`engine.eviction: value:auto`, in every EAGLE mode: the engine's pool regrets the same
    evictions and refusals as the simulator's, so its T and admission bias move alike (compared
    after every request) and it evicts the same states. Fails if either side does not report evictions, refusals or a
    request's prompt to the policy (`evicted`, `refused`, `missed`)."""
    _, _, num_regrets = run_both(tiny_model, k, eagle, "value:auto", "dense")
    assert num_regrets >= 2


@pytest.mark.heavy
def test_the_engine_places_what_the_simulator_places(tiny_model):
    """`value:BYTES` placement (`cache_service/placement.py`): the engine's planner learns the same
    match depths from its lookups as the simulator's and places the same states."""
    page = tiny_model.state_bytes_per_slot()
    _, num_placed, _ = run_both(tiny_model, 3, "drop", "value", f"value:{2 * page}")
    assert num_placed >= 2


@pytest.mark.heavy
def test_on_the_attention_grid_too(tiny_model):
    """`engine.checkpoint_grid: attention`: states on the 16-token grid, one at least every 64."""
    _, num_placed, _ = run_both(tiny_model, 3, "lossless", "value", "latest", grid="attention")
    assert num_placed >= 10  # the spacing bound's grid states


def run_both(tiny_model, k: int, eagle: str, eviction: str, retention: str,
             grid: str = "mamba") -> tuple[int, int, int]:
    """Serve `history(3)` on the engine and on a simulated replica, comparing after every request;
    returns the spare KV blocks seen and the grid positions planned, summed over requests, and the
    evictions and refusals `value:auto` regretted (0 for the other policies)."""
    page = tiny_model.state_bytes_per_slot()
    memory = 24 * 2**20
    engine = make_engine(tiny_model, num_spec_tokens=k, eagle_mode=eagle, eviction=eviction, retention=retention,
                         checkpoint_grid=grid,
                         max_model_len=1024, cache_memory_bytes=memory, mamba_memory_fraction=0.3,
                         checkpoint_memory_fraction=3 * page / memory + 1e-9)  # 3 retained states
    cache = engine.cache
    assert (cache.mamba.eviction.name, cache.mamba.max_retained_pages) == (eviction.partition(":")[0], 3)
    if eviction.startswith("value:") and eviction != "value:auto":  # the setting reached the engine's policy
        assert cache.mamba.eviction.tau_per_mean_reuse == float(eviction.partition(":")[2])
    coord = HybridCoordinator(cache.layout, cache.coordinator.eagle, drop_rule=DropRule(engine.config.drop_rule))
    assert cache.layout.alignment == (16 if grid == "attention" else 64)
    planner = CheckpointPlanner(coord, make_retention(retention, cache.layout.alignment, state_bytes=page,
                                                      spacing=engine.config.checkpoint_spacing))
    sizes = [pool.num_blocks for pool in cache.pools]
    replica = SimReplica("r", coord, planner, sizes, index=None, eviction=EvictionConfig(eviction),
                         state_page_bytes=cache.mamba.page_size_bytes, max_retained_pages=3)
    (sim_mamba,) = replica.cache.groups.of_kind("mamba")
    # 4 tokens: the draft layer covers the prompt (a request that stops at its prefill leaves its
    # last chunk undrafted, the simulator's trace requests never do); trimmed lengths keep the
    # decoded tokens inside the prompt's last block and alignment unit, so both publish the same
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    num_hits = num_spare = num_placed = 0
    for i, prompt in enumerate(history(3)):
        hashes = RequestBlockHashes(cache.layout.hash_block_size, prompt,
                                    model_fingerprint=engine.config.model_fingerprint)
        n = len(prompt)
        hit = replica.lookup(hashes, n)
        planner.observe(hit.attention_match_tokens)
        num_placed += len(planner.periodic(n, n, coord.junctions(hit)))
        replica.publish(hashes, hit.hit_tokens, n, coord.junctions(hit))
        (out,) = engine.generate([prompt], params)
        assert out.num_cached_tokens == hit.hit_tokens, i
        num_hits += hit.hit_tokens > 0
        assert set(cache.mamba.pool.cached) == set(sim_mamba.pool.cached), i
        for spec, pool, sim_pool in zip(cache.layout.groups, cache.pools, replica.cache.pools):
            if spec.is_attention:  # the same KV blocks, and the same ones spare (no state above them)
                assert set(pool.cached) == set(sim_pool.cached), i
                assert pool.num_spare_blocks == sim_pool.num_spare_blocks, i
                num_spare += pool.num_spare_blocks
        assert dict(cache.mamba.eviction.known()) == dict(sim_mamba.eviction.known()), i
        assert (cache.mamba.num_evictions, cache.mamba.num_snapshots_skipped) == (
            sim_mamba.num_evictions, sim_mamba.num_snapshots_skipped), i
        assert cache.mamba.eviction.now == sim_mamba.eviction.now == i + 1
        learned = ("tau_per_mean_reuse", "bias", "num_regrets")  # value:auto's
        assert [getattr(cache.mamba.eviction, a, None) for a in learned] == [
            getattr(sim_mamba.eviction, a, None) for a in learned], i
        assert getattr(cache.planner.policy, "stats", None) == getattr(planner.policy, "stats", None), i
    assert num_hits >= 3 and sim_mamba.num_evictions + sim_mamba.num_snapshots_skipped >= 10
    return num_spare, num_placed, getattr(sim_mamba.eviction, "num_regrets", 0)
