"""Tiny requests (16 prompt tokens, 1 output token) through the Ray backend vs the in-process
backend, at a given concurrency: the control plane's fixed cost per request (part of
`python -m bench.control_plane`)."""

from __future__ import annotations

import random
import time


def tiny_requests(model_dir: str, num_requests: int, concurrency: int, rounds: int = 3) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams
    from workers.engine_runner import EngineRunner

    engine = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=64 * 2**20,
                          max_num_seqs=concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 250) for _ in range(16)] for _ in range(num_requests)]

    def run(backend) -> float:
        def one(p):
            return list(backend.submit(p, params))[-1]

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, prompts[:concurrency]))  # warm-up
            t0 = time.perf_counter()
            list(pool.map(one, prompts))
            return num_requests / (time.perf_counter() - t0)

    runner = EngineRunner(LLMEngine.from_checkpoint(model_dir, engine))
    backend = ClusterBackend(model_dir, engine, ClusterConfig(name=None, num_replicas=1))
    try:  # alternate, best of `rounds` each: these cores are shared, so a slow round is noise
        local, remote = [], []
        for _ in range(rounds):
            local.append(run(runner))
            remote.append(run(backend))
    finally:
        runner.shutdown()
        backend.shutdown()
    return {"inprocess_rps": round(max(local), 1), "ray_rps": round(max(remote), 1),
            "ratio": round(max(remote) / max(local), 2), "rounds": rounds}
