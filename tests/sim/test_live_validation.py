"""The simulator against the live cluster: the same scaled trace slice, sent in a fixed order
(one request at a time) through a real 2-replica Ray cluster on loopback with the tiny model,
then replayed through the simulator with the tiny model's layout, the same EAGLE mode and
retention, each request placed where the live router placed it (the live router breaks ties at
random) and, as the live front door does, given the pages of a replica that hits more before it
is served there. Every request's simulated hit equals the live engine's `num_cached_tokens` (what
`usage.prompt_tokens_details.cached_tokens` reports)."""

import dataclasses
import time

import pytest

from cache_service.trace_sim.cli import DEFAULT_TRACE
from cache_service.trace_sim.config import load_cost_model, load_layout
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cluster.loadtest.trace_workload import trace_prompts, trace_slice
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]

# the live engine's layout is full:16 + mamba:64 + draft:16 (MTP): configs/sim/layouts.yaml tiny-nemotron-h
CONFIG = EngineConfig(kernels="torch", max_model_len=2048, kv_block_size=16, mamba_block_size=64,
                      num_spec_tokens=3, eagle_mode="lossless", retention="latest",
                      cache_memory_bytes=256 * 2**20)
# 16 tokens per trace block; two slices of the shipped trace, one after the other: [3280, 3316)
# has siblings whose hits depend on retention (dense would hit 4 more), [3750, 3774) follow-up
# turns that hit their predecessor's final snapshot; ~40K prompt tokens in all
SLICES, SCALE = ((3280, 36), (3750, 24)), 1 / 32


def wait_until_indexed(backend, max_polls: int = 600) -> None:
    """Until the cache service's index equals every replica's cache (events arrive at most an
    engine step or heartbeat after a request ends): the router then sees what the simulator's
    index sees, and a holder is never missed for want of its last events."""
    for _ in range(max_polls):
        problems = backend.index_problems()
        if not problems:
            return
        time.sleep(0.05)
    pytest.fail(f"the index never caught up with the replicas: {problems}")


def test_simulated_hits_equal_the_live_clusters_cached_tokens(ray_session, tiny_dir):
    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend

    requests = [r for start, limit in SLICES
                for r in trace_slice(str(DEFAULT_TRACE), start, limit, SCALE, 1.0, CONFIG.max_model_len - 1)]
    # one at a time in simulated time too: each arrives after the previous one has published
    requests = [dataclasses.replace(r, index=i, arrival_s=1000.0 * i) for i, r in enumerate(requests)]
    prompts = trace_prompts(requests)
    backend = ClusterBackend(tiny_dir, CONFIG, ClusterConfig(name=None, num_replicas=2))
    try:
        ids = list(backend.replica_ids)
        live = []
        for prompt in prompts:  # one at a time: each finishes and is in the index before the next
            out, replica = backend.generate(list(prompt), SamplingParams(temperature=0.0, max_tokens=1,
                                                                         ignore_eos=True))
            live.append((ids.index(replica), out.num_cached_tokens))
            wait_until_indexed(backend)
    finally:
        backend.shutdown()
    sim = ClusterSim(SimSettings(load_layout("tiny-nemotron-h"), load_cost_model("cpu"), 2, "hybrid",
                                 CONFIG.cache_memory_bytes, retention=CONFIG.retention, eagle="lossless"))
    simulated = [sim.step(req, forced_replica=replica).hit_tokens for req, (replica, _) in zip(requests, live)]
    assert simulated == [hit for _, hit in live]
    assert sum(1 for h in simulated if h) >= 7  # the slices really exercise hits
    assert len({replica for replica, _ in live}) == 2  # and both replicas served
