"""Transfer throughput vs raw send/recv on the same gloo channel (two processes on loopback).

Rank 0 serves a long prompt on a real engine, then sends its cached prefix pages
(export + header + checksum + send) to rank 1, which receives, verifies and registers them
(recv + checksum + import); a raw `dist.send` of the same byte count is the baseline.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, model_dir: str, prompt_len: int, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        import random

        from cache_service.block_hash import RequestBlockHashes
        from workers.engine.config import EngineConfig
        from workers.engine.engine import LLMEngine
        from workers.engine.sampling import SamplingParams
        from workers.transfer import export_prefix, import_prefix, recv_prefix, send_prefix

        config = EngineConfig(kernels="torch", max_model_len=prompt_len + 64, cache_memory_bytes=512 * 2**20)
        engine = LLMEngine.from_checkpoint(model_dir, config)
        prompt = [random.Random(5).randrange(engine.vocab_size) for _ in range(prompt_len)]
        hashes = RequestBlockHashes(engine.cache.layout.hash_block_size, prompt,
                                    model_fingerprint=engine.config.model_fingerprint)
        hit = (prompt_len - 1) // engine.cache.alignment * engine.cache.alignment
        if rank == 0:
            engine.generate([prompt], SamplingParams(max_tokens=1))
            header, payload = export_prefix(engine.cache, hashes, hit)
            dist.send(torch.tensor([payload.numel()]), 1)
        else:
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, 0)
            payload = torch.empty(int(size), dtype=torch.uint8)
        raw_s, transfer_s = [], []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(payload, 1)
            else:
                dist.recv(payload, 0)
            raw_s.append(time.perf_counter() - t0)
            if rank == 1:
                for pool in engine.cache.pools:  # measure a full registration each time
                    pool.reset_prefix_cache()
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                send_prefix(*export_prefix(engine.cache, hashes, hit), dst=1)
            else:
                header, received = recv_prefix(src=0)
                import_prefix(engine.cache, header, received)
            transfer_s.append(time.perf_counter() - t0)
        if rank == 1:
            nbytes = payload.numel()
            raw, tr = min(raw_s), min(transfer_s)
            queue.put({"num_tokens": hit, "payload_mb": round(nbytes / 2**20, 2),
                       "raw_send_recv_mb_s": round(nbytes / raw / 2**20, 1),
                       "transfer_mb_s": round(nbytes / tr / 2**20, 1), "transfer_over_raw": round(raw / tr, 3),
                       "target_ratio": 0.8})
    finally:
        dist.destroy_process_group()


def measure_transfer(model_dir: str, prompt_len: int = 4096, repeats: int = 5) -> dict:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, model_dir, prompt_len, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return result
