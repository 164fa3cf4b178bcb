"""`python -m bench.cluster`: routing decision latency and state-transfer throughput, as JSON.

Routing: an 8K-token prompt against a global index of 1M entries spread over 8 replicas, the
engine's layout (full:16, mamba:64, draft:16), policy `hybrid`. The timed decision includes
hashing the prompt and the per-replica reconciled lookups. Target p99 <= 2 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from bench.random_checkpoint import CheckpointError, random_checkpoint
from cache_service import CacheLayout, EagleMode, HybridCoordinator, RequestBlockHashes
from cache_service.global_index import GlobalIndex
from cache_service.router import Router, RoutingPolicy
from cache_service.simulate import make_tokens
from cache_service.specs import parse_group_spec


def measure_routing(num_entries: int, num_replicas: int, prompt_len: int, repeats: int) -> dict:
    layout = CacheLayout(tuple(parse_group_spec(g) for g in ("full:16", "mamba:64", "draft:16")))
    coord = HybridCoordinator(layout, EagleMode.LOSSLESS)
    index = GlobalIndex(len(layout.groups))
    tokens = make_tokens(prompt_len, 1, 128_000)
    hashes = RequestBlockHashes(layout.hash_block_size, tokens)
    per_replica = num_entries // num_replicas
    for r in range(num_replicas):
        filler = [os.urandom(16) for _ in range(per_replica)]
        held = prompt_len * (r + 1) // num_replicas // 64 * 64  # replica r holds a prefix of growing length
        full = [hashes.prefix_hash(e) for e in range(16, held + 1, 16)]
        mamba = [hashes.prefix_hash(held)] if held else []
        third = per_replica // 3
        index.resync(f"r{r}", [filler[:third] + full, filler[third : 2 * third] + mamba,
                               filler[2 * third :] + full], 0)
    router = Router(index, coord, RoutingPolicy.HYBRID)
    loads = {f"r{r}": 100 * r for r in range(num_replicas)}
    times, decision = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = RequestBlockHashes(layout.hash_block_size, tokens)
        decision = router.route(h.hashes, prompt_len, loads)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "num_indexed_entries": index.num_entries, "num_replicas": num_replicas, "prompt_len": prompt_len,
        "chosen_replica": decision.replica_id, "expected_hit_tokens": decision.expected_hit_tokens,
        "p50_ms": round(statistics.median(times) * 1e3, 4),
        "p99_ms": round(times[int(0.99 * (len(times) - 1))] * 1e3, 4),
        "target_p99_ms": 2.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__)
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--model", help="checkpoint for the transfer benchmark (default: a fresh random tiny one)")
    p.add_argument("--transfer-tokens", type=int, default=4096, help="0 skips the transfer benchmark")
    p.add_argument("--wide-kv", action="store_true",
                   help="also time a transfer on the tiny model widened to 8 KV heads x 128 (pages ~8x larger, "
                        "closer to a real model's page sizes)")
    args = p.parse_args(argv)
    report = {"routing": measure_routing(args.entries, args.replicas, args.prompt_len, args.repeats)}
    if args.transfer_tokens:
        from bench.transfer import measure_transfer

        with contextlib.ExitStack() as stack:  # random checkpoints are removed after the run
            try:
                model_dir = args.model or stack.enter_context(random_checkpoint())
                report["transfer"] = measure_transfer(model_dir, args.transfer_tokens)
                if args.wide_kv:  # 8 KV heads of 128: ~25 KB of pages per token
                    wide = stack.enter_context(random_checkpoint(num_attention_heads=8, num_key_value_heads=8,
                                                                 head_dim=128))
                    report["transfer_wide_kv"] = measure_transfer(wide, args.transfer_tokens)
            except CheckpointError as exc:
                p.error(str(exc))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
