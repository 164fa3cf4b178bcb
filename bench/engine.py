"""`python -m bench.engine`: cold vs warm TTFT on an identical long resend, and decode speed
with and without MTP speculation, on one engine, as JSON (ratios within one run).

Without `--model` a random-weight tiny checkpoint is written to a temp dir first (random
weights make MTP acceptance ~0, so the speed-up needs a trained checkpoint).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time

import torch


def _engine(model, **kw):
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine

    return LLMEngine(model, EngineConfig(**kw))


def measure_ttft(model, prompt_len: int, repeats: int, eagle: str, k: int, max_model_len: int) -> dict:
    from workers.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=1)
    warmup = _engine(model, num_spec_tokens=k, eagle_mode=eagle, max_model_len=max_model_len,
                     cache_memory_bytes=512 * 2**20)
    warmup.generate([[r % model.config.vocab_size for r in range(prompt_len)]], params)  # one-time init costs
    cold, warm, hits, exact = [], [], [], True
    for r in range(repeats):
        engine = _engine(model, num_spec_tokens=k, eagle_mode=eagle, max_model_len=max_model_len,
                         cache_memory_bytes=512 * 2**20)
        prompt = [random.Random(r).randrange(model.config.vocab_size) for _ in range(prompt_len)]
        (a,) = engine.generate([prompt], params)
        (b,) = engine.generate([prompt], params)
        cold.append(a.ttft_s)
        warm.append(b.ttft_s)
        hits.append(b.num_cached_tokens)
        exact &= a.token_ids == b.token_ids
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prompt_len": prompt_len, "eagle": eagle, "num_spec_tokens": k, "hit_tokens": hits[0],
            "cold_ttft_s": round(c, 4), "warm_ttft_s": round(w, 4), "warm_over_cold": round(w / c, 4),
            "warm_equals_cold": exact, "target_ratio": 0.05}


def measure_decode(model, k: int, num_tokens: int, eagle: str) -> dict:
    from workers.engine.sampling import SamplingParams

    engine = _engine(model, num_spec_tokens=k, eagle_mode=eagle, max_model_len=4096)
    prompt = [random.Random(99).randrange(model.config.vocab_size) for _ in range(64)]
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = engine.generate([prompt], params)
    elapsed = time.perf_counter() - t0 - out.ttft_s
    accept = out.num_draft_accepted / out.num_draft_proposed if out.num_draft_proposed else None
    return {"num_spec_tokens": k, "decode_tokens_per_s": round((len(out.token_ids) - 1) / elapsed, 1),
            "draft_acceptance": None if accept is None else round(accept, 3), "token_ids": list(out.token_ids)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__)
    p.add_argument("--model", help="checkpoint dir (default: a fresh random tiny checkpoint)")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--eagle", default="lossless", choices=["drop", "lossless"])
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from workers.model.loader import load_model

    model_dir = args.model
    if model_dir is None:
        from workers.model.init_model import main as init_main

        model_dir = tempfile.mkdtemp(prefix="hybridserve-tiny-")
        init_main(["--config", "configs/models/tiny-nemotron-h.yaml", "--out", model_dir])
    model = load_model(model_dir)
    report = {"model": model_dir, "torch_threads": torch.get_num_threads()}
    report["resend"] = measure_ttft(model, args.prompt_len, args.repeats, args.eagle, 3, args.prompt_len + 64)
    plain = measure_decode(model, 0, args.decode_tokens, args.eagle)
    spec = measure_decode(model, 3, args.decode_tokens, args.eagle)
    report["decode"] = {
        "no_spec_tokens_per_s": plain["decode_tokens_per_s"], "mtp_k3_tokens_per_s": spec["decode_tokens_per_s"],
        "speedup": round(spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"], 3),
        "mtp_acceptance": spec["draft_acceptance"], "outputs_equal": plain["token_ids"] == spec["token_ids"],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
