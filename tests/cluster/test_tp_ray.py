"""A TP=2 replica through real Ray on loopback: rank 1 is a `TPWorker` actor, gloo between them."""

import os

import pytest
import torch

from tests.conftest import make_engine
from tests.model.tp_helpers import TRAINED, code_prompts
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import load_model
from workers.tp_worker import create_tp_engine

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(240)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    import ray

    os.environ["RAY_TMPDIR"] = str(tmp_path_factory.mktemp("ray"))
    if not ray.is_initialized():
        ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_tp2_ray_replica_greedy_equals_tp1_and_warm_hit_equals_cold(ray_session):
    torch.set_num_threads(1)
    prompts = code_prompts()
    ref = make_engine(load_model(TRAINED, kernels="torch"), num_spec_tokens=3).generate(prompts, PARAMS)
    config = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=96 * 2**20, num_spec_tokens=3)
    engine = create_tp_engine(str(TRAINED), config, 2, ray_actor_options={"num_cpus": 1})
    try:
        assert engine.model.tp_size == 2 and engine.speculative
        cold = engine.generate(prompts, PARAMS)
        assert [o.token_ids for o in cold] == [o.token_ids for o in ref]
        assert [o.num_draft_accepted for o in cold] == [o.num_draft_accepted for o in ref]
        (warm,) = engine.generate([prompts[2]], PARAMS)
        # 387 tokens, full:16 + mamba:64 + draft:16 (A = 64), lossless: floor(386 / 64) * 64 = 384
        assert warm.num_cached_tokens == 384 and warm.token_ids == cold[2].token_ids
    finally:
        engine.model.close()
    assert engine.model.closed


def test_tp2_replicas_behind_the_cluster_backend_serve_and_hit(ray_session):
    """A replica actor = rank 0 + a TPWorker actor; routed, cached and streamed like TP=1."""
    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend

    prompts = code_prompts()
    ref = make_engine(load_model(TRAINED, kernels="torch"), num_spec_tokens=3).generate(prompts[:2], PARAMS)
    config = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=64 * 2**20, num_spec_tokens=3)
    backend = ClusterBackend(str(TRAINED), config, ClusterConfig(name=None, num_replicas=1, tp_size=2))
    try:
        cold = [backend.generate(p, PARAMS)[0] for p in prompts[:2]]
        assert [o.token_ids for o in cold] == [o.token_ids for o in ref]
        (actor,) = [backend.replicas.get(r).actor for r in backend.replica_ids]
        before = ray_session.get(actor.work_counts.remote())
        warm, _ = backend.generate(prompts[1], PARAMS)
        # 90 tokens, full:16 + mamba:64 + draft:16 (A = 64), lossless: floor(89 / 64) * 64 = 64
        assert warm.num_cached_tokens == 64 and warm.token_ids == cold[1].token_ids
        # rank 0 and the TPWorker actor each ran only the prompt's tokens past the hit
        after = ray_session.get(actor.work_counts.remote())
        rest = len(prompts[1]) - warm.num_cached_tokens
        assert warm.num_computed_prompt_tokens == rest
        assert after.num_computed_prompt_tokens - before.num_computed_prompt_tokens == rest
        assert [a.num_prompt_tokens - b.num_prompt_tokens for a, b in zip(after.ranks, before.ranks)] == [rest] * 2
    finally:
        backend.shutdown()


def test_tp2_prefill_hands_off_to_a_tp2_decoder(ray_session):
    """`cluster.pd` 1:1 with TP 2 replicas (each rank 0 + a TPWorker actor): every request prefills on
    the prefill replica and is handed off with every rank's shard of its pages; outputs equal one TP 1
    engine's token for token, each token streamed once, and no rank of the decoder runs a prompt
    token. The prompts prefill in 80-token chunks, so the finished chunks' attention blocks go to the
    decoder while the rest computes (kv-only prefix transfers, every rank's shard) and the hand-off
    skips them. Catches: a hand-off that carries rank 0's shard only (the decoder's rank 1 would decode
    from stale pages and the output diverge), a decoder that re-prefills, a kept hand-off (the count),
    no early sends at TP 2 (the count) or early pages the hand-off does not use (skipped bytes 0)."""
    from cluster.config import ClusterConfig, PDConfig
    from cluster.frontdoor.backend import ClusterBackend

    prompts = code_prompts()[1:]
    config = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=32 * 2**20, num_spec_tokens=3,
                          max_num_batched_tokens=80)
    ref = LLMEngine(load_model(TRAINED, kernels="torch"), config).generate(prompts, PARAMS)
    backend = ClusterBackend(str(TRAINED), config, ClusterConfig(name=None, num_replicas=2, tp_size=2,
                                                                 pd=PDConfig(num_prefill=1, num_decode=1)))
    try:
        roles = {rep.role: r for r, rep in backend.replicas.replicas.items()}
        decoder = backend.replicas.get(roles["decode"]).actor
        for prompt, want in zip(prompts, ref):
            outs = list(backend.submit(prompt, PARAMS))
            assert outs[-1].finished and outs[-1].token_ids == want.token_ids
            assert [t for o in outs for t in o.new_token_ids] == list(want.token_ids)
        work = ray_session.get(decoder.work_counts.remote())
        assert work.num_computed_prompt_tokens == 0 and [r.num_prompt_tokens for r in work.ranks] == [0, 0]
        counts = backend.handoff_counts
        assert (counts["handoffs"], counts["handoffs_kept"]) == (len(prompts), 0) and counts["early_page_sends"] >= 1
        stats = ray_session.get(backend.controller.stats.remote())
        assert stats["transfers"] >= 1 and stats["handoff_skipped_bytes"] > 0
    finally:
        backend.shutdown()
