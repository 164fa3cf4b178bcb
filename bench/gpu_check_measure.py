"""What `make gpu-check` measures on CUDA (bench/gpu_check.py runs each in a subprocess under a time limit).

    measure_engine    output tokens/s at concurrency 1 and 32: bench.engine's held-out prompts through
                      bench.concurrency, the shipped tiny model on the GPU
    measure_transfer  two processes, one GPU each, one PairChannel over NCCL: a raw send of N bytes, then
                      the cached prefix of the same N bytes through send_prefix / recv_prefix (the replicas'
                      path, checksummed and registered on the receiver); MB/s as the receiver sees them

Both take `device` / `backend` so that they can be run on the CPU with gloo as well (a smoke run of the
code, not a GPU figure).
"""

from __future__ import annotations

import os
import random
import time
from queue import Empty

import torch

TRAINED = "configs/models/tiny-trained"


def measure_engine(device: str = "cuda", levels: tuple[int, ...] = (1, 32), num_tokens: int = 64,
                   repeats: int = 3, prompt_len: int = 128) -> dict:
    from bench.concurrency import measure_concurrency
    from bench.engine import decode_prompts
    from workers.model.loader import load_model

    model = load_model(TRAINED, device=device)
    prompts = decode_prompts(max(levels), prompt_len, model.config.vocab_size)
    report = measure_concurrency(model, list(levels), prompts, num_tokens, repeats)
    return {**report, "device": str(model.device), "kernels": model.kernels.name}


def prefix_nbytes(cache, num_tokens: int) -> int:
    """Bytes a transfer of a `num_tokens` hit moves: per group, its pages x the page's bytes in every tensor."""
    from workers.transfer import group_tensors

    total = 0
    for g, spec in enumerate(cache.layout.groups):
        pages = 1 if spec.kind == "mamba" else cache.coordinator.serving_extent(g, num_tokens) // cache.block_size
        total += pages * sum(t[0].numel() * t.element_size() for t in group_tensors(cache, g))
    return total


def _transfer_rank(rank: int, port: int, backend: str, device: str, prompt_len: int, repeats: int, queue) -> None:
    out: dict = {"rank": rank, "phase": "setup"}
    try:
        _transfer_rank_body(rank, port, backend, device, prompt_len, repeats, out)
    except Exception as exc:  # the parent reports it with the phase it happened in
        out["error"] = f"rank {rank}, {out['phase']}: {type(exc).__name__}: {exc}"[:500]
    queue.put(out)


def _transfer_rank_body(rank: int, port: int, backend: str, device: str, prompt_len: int, repeats: int,
                        out: dict) -> None:
    import torch.distributed as dist

    from bench.transfer import timed_prefix_move, timed_raw_send
    from cache_service.block_hash import RequestBlockHashes
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams
    from workers.transfer_channel import PairChannel

    torch.set_num_threads(1)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)

    def sync() -> None:  # an NCCL wait() orders the stream, not the host
        if cuda:
            torch.cuda.synchronize()

    out["phase"] = "channel"
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
    channel = PairChannel("gpu-check", rank, ("127.0.0.1", port), store=store, backend=backend)
    token = torch.zeros(1, device=device)

    def barrier() -> None:  # a round trip on the same channel
        for send in ((True, False) if rank == 0 else (False, True)):
            (channel.isend if send else channel.irecv)(token).wait()
        sync()

    out["phase"] = "engine"
    engine = LLMEngine.from_checkpoint(TRAINED, EngineConfig(device=device, max_model_len=prompt_len + 64,
                                                             cache_memory_bytes=512 * 2**20))
    rng = random.Random(5)
    prompt = [rng.randrange(engine.vocab_size) for _ in range(prompt_len)]
    hashes = RequestBlockHashes(engine.cache.layout.hash_block_size, prompt,
                                model_fingerprint=engine.config.model_fingerprint)
    hit = (prompt_len - 1) // engine.cache.alignment * engine.cache.alignment
    if rank == 0:
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    payload = torch.ones(prefix_nbytes(engine.cache, hit), dtype=torch.uint8, device=device)
    out.update(num_tokens=hit, payload_mb=round(payload.numel() / 2**20, 2), backend=backend, device=device,
               kernels=engine.model.kernels.name)

    out["phase"] = "raw send"
    raw_s = [timed_raw_send(channel, rank, payload, barrier, sync) for _ in range(repeats)]
    out["raw_mb_s"] = round(payload.numel() / min(raw_s) / 2**20, 1)

    out["phase"] = "transfer"
    transfer_s, stored = [], 0
    for _ in range(repeats):
        seconds, stored = timed_prefix_move(engine, hashes, hit, channel, rank, barrier, sync)
        transfer_s.append(seconds)
    out.update(transfer_mb_s=round(payload.numel() / min(transfer_s) / 2**20, 1),
               transfer_over_raw=round(min(raw_s) / min(transfer_s), 3), pages_stored=stored, phase="done")


def measure_transfer(backend: str = "nccl", devices: tuple[str, str] = ("cuda:0", "cuda:1"), prompt_len: int = 4096,
                     repeats: int = 5, timeout_s: float = 80.0) -> dict:
    """The receiver's figures; `error` names the first rank that failed and where."""
    import torch.multiprocessing as mp

    from workers.transfer_channel import free_port

    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_transfer_rank, args=(r, port, backend, devices[r], prompt_len, repeats, queue))
             for r in range(2)]
    for proc in procs:
        proc.start()
    by_rank: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(by_rank) < 2 and time.monotonic() < deadline:
            wait = deadline - time.monotonic()
            if any("error" in r for r in by_rank.values()):
                wait = min(wait, 10.0)  # its peer may wait forever on a message that never comes
            try:
                got = queue.get(timeout=max(0.1, wait))
            except Empty:  # the rest is reported as missing
                break
            by_rank[got["rank"]] = got
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    result = dict(by_rank.get(1) or by_rank.get(0) or {})
    errors = [r["error"] for _, r in sorted(by_rank.items()) if "error" in r]
    errors += [f"rank {r}: no result within {timeout_s:.0f} s" for r in range(2) if r not in by_rank]
    if errors:
        result["error"] = "; ".join(errors)
    return result
