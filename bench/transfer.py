"""Transfer throughput vs raw send/recv on the same gloo channel (two processes on loopback).

Rank 0 serves a long prompt on a real engine, then streams its cached prefix pages to rank 1
(pin, gather chunk k+1 while chunk k is on the wire, trailer checksum), which receives, copies
into its own pages, verifies and registers them; a raw send of the same byte count over the same
`PairChannel` (the replicas' channel) is the baseline.
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


def _no_sync() -> None:
    pass


def timed_raw_send(channel, rank: int, payload: torch.Tensor, barrier, sync=_no_sync) -> float:
    """Seconds a raw send (rank 0) or receive (rank 1) of `payload` takes, after a `barrier`
    (`sync`: wait for the device, where the channel's wait orders only a stream)."""
    barrier()
    t0 = time.perf_counter()
    (channel.isend if rank == 0 else channel.irecv)(payload).wait()
    sync()
    return time.perf_counter() - t0


def timed_prefix_move(engine, hashes, hit: int, channel, rank: int, barrier, sync=_no_sync) -> tuple[float, int]:
    """(seconds, pages stored) of `send_prefix` (rank 0) / `recv_prefix` (rank 1) of a `hit`-token
    prefix, after a `barrier`; the receiver forgets its cached prefix first, so every repeat is a
    full registration. Pages stored: the receiver's count (0 on rank 0)."""
    from workers.transfer_recv import recv_prefix
    from workers.transfer_send import send_prefix

    if rank == 1:
        for pool in engine.cache.pools:
            pool.reset_prefix_cache()
    barrier()
    t0 = time.perf_counter()
    stored = 0
    if rank == 0:
        send_prefix(engine.cache, hashes, hit, channel)
    else:
        stored = recv_prefix(engine.cache, channel)
    sync()
    return time.perf_counter() - t0, stored


def _worker(rank: int, port: int, model_dir: str, prompt_len: int, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    from workers.transfer_channel import PairChannel

    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
    channel = PairChannel("bench", rank, ("127.0.0.1", port), store=store)
    import random

    from cache_service.block_hash import RequestBlockHashes
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams

    config = EngineConfig(kernels="torch", max_model_len=prompt_len + 64, cache_memory_bytes=512 * 2**20)
    engine = LLMEngine.from_checkpoint(model_dir, config)
    prompt = [random.Random(5).randrange(engine.vocab_size) for _ in range(prompt_len)]
    hashes = RequestBlockHashes(engine.cache.layout.hash_block_size, prompt,
                                model_fingerprint=engine.config.model_fingerprint)
    hit = (prompt_len - 1) // engine.cache.alignment * engine.cache.alignment
    size = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        from workers.transfer import export_prefix

        size[0] = export_prefix(engine.cache, hashes, hit)[1].numel()
        channel.isend(size).wait()
    else:
        channel.irecv(size).wait()
    payload = torch.ones(int(size), dtype=torch.uint8)
    sync = torch.zeros(1)

    def barrier() -> None:  # a round trip on the same channel
        if rank == 0:
            channel.isend(sync).wait()
            channel.irecv(sync).wait()
        else:
            channel.irecv(sync).wait()
            channel.isend(sync).wait()

    raw_s, transfer_s = [], []
    for _ in range(repeats):
        raw_s.append(timed_raw_send(channel, rank, payload, barrier))
        transfer_s.append(timed_prefix_move(engine, hashes, hit, channel, rank, barrier)[0])
    if rank == 1:
        nbytes = payload.numel()
        raw, tr = min(raw_s), min(transfer_s)
        queue.put({"num_tokens": hit, "payload_mb": round(nbytes / 2**20, 2),
                   "raw_send_recv_mb_s": round(nbytes / raw / 2**20, 1),
                   "transfer_mb_s": round(nbytes / tr / 2**20, 1), "transfer_over_raw": round(raw / tr, 3),
                   "target_ratio": 0.8})


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
