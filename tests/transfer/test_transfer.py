"""Prefix pages move between replicas and serve a normal, byte-exact local hit there."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cache_service.block_hash import RequestBlockHashes
from tests.conftest import make_engine, make_prompt
from workers.engine.sampling import SamplingParams
from workers.transfer import TransferError, export_prefix, import_prefix, recv_prefix, send_prefix

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _hashes(engine, prompt):
    return RequestBlockHashes(engine.cache.layout.hash_block_size, prompt,
                              model_fingerprint=engine.config.model_fingerprint)


@pytest.mark.parametrize("eagle", ["drop", "lossless"])
def test_transferred_prefix_is_a_local_hit_with_identical_output(tiny_model, eagle):
    src, dst = (make_engine(tiny_model, num_spec_tokens=3, eagle_mode=eagle) for _ in range(2))
    prompt = make_prompt(500, 3)
    (cold,) = src.generate([prompt], PARAMS)
    hit = 448 if eagle == "lossless" else 384
    header, payload = export_prefix(src.cache, _hashes(src, prompt), hit)
    assert import_prefix(dst.cache, header, payload) == sum(len(keys) for keys in header.keys)
    dst.cache.check_integrity()
    (warm,) = dst.generate([prompt], PARAMS)
    assert warm.num_cached_tokens == hit and warm.token_ids == cold.token_ids
    assert import_prefix(dst.cache, header, payload) == 0  # already there: nothing new stored


def test_corrupt_or_incompatible_transfers_are_refused(tiny_model):
    src = make_engine(tiny_model, num_spec_tokens=0)
    prompt = make_prompt(300, 4)
    src.generate([prompt], PARAMS)
    header, payload = export_prefix(src.cache, _hashes(src, prompt), 256)
    bad = payload.clone()
    bad[100] ^= 0xFF
    dst = make_engine(tiny_model, num_spec_tokens=0)
    with pytest.raises(TransferError, match="checksum"):
        import_prefix(dst.cache, header, bad)
    with pytest.raises(TransferError, match="tp_size"):
        import_prefix(dst.cache, header, payload, tp_size=2)
    other = make_engine(tiny_model, num_spec_tokens=0, kv_block_size=32)
    with pytest.raises(TransferError, match="kv_block_size"):
        import_prefix(other.cache, header, payload)
    with pytest.raises(TransferError, match="not cached"):
        export_prefix(src.cache, _hashes(src, make_prompt(300, 5)), 256)
    assert dst.cache.pools[0].num_cached_blocks == 0  # nothing half-registered
    (warm,) = dst.generate([prompt], PARAMS)
    assert warm.num_cached_tokens == 0  # fell back to recompute


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, model_dir, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from workers.engine.config import EngineConfig
        from workers.engine.engine import LLMEngine

        engine = LLMEngine.from_checkpoint(model_dir, EngineConfig(kernels="torch", max_model_len=2048,
                                                                  cache_memory_bytes=64 * 2**20))
        prompt = make_prompt(600, 8)
        if rank == 0:
            (cold,) = engine.generate([prompt], PARAMS)
            send_prefix(*export_prefix(engine.cache, _hashes(engine, prompt), 576), dst=1)
            queue.put(("src", list(cold.token_ids), cold.num_cached_tokens))
        else:
            header, payload = recv_prefix(src=0)
            import_prefix(engine.cache, header, payload)
            (warm,) = engine.generate([prompt], PARAMS)
            queue.put(("dst", list(warm.token_ids), warm.num_cached_tokens))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_rank_to_rank_over_gloo_on_loopback(tiny_dir):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [ctx.Process(target=_worker, args=(r, port, tiny_dir, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((name, (tokens, hit)) for name, tokens, hit in (queue.get(timeout=150) for _ in range(2)))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results["src"][1] == 0 and results["dst"][1] == 576
    assert results["dst"][0] == results["src"][0]
