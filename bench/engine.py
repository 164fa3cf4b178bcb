"""`python -m bench.engine`: cold vs warm TTFT on an identical long resend, and greedy decode speed
with MTP speculation (k=3) vs without, as JSON (ratios within one run). With `--concurrency 1,4,16,32`
it measures output tokens/s at each concurrency level instead (bench/concurrency.py).

Decode: prompts are windows of held-out stdlib text (the train-tiny split); for each repetition and
prompt the k=0 and k=3 engines run back to back (order alternating) with a fresh cache salt, and the
decode time (first token to last) is summed per engine, so load drift hits both alike.

The default model is the shipped trained checkpoint (configs/models/tiny-trained); `--model random`
writes a random-weight tiny checkpoint first (MTP acceptance ~0 there, so no speed-up).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time

import torch

from bench.random_checkpoint import CheckpointError, random_checkpoint

TRAINED = "configs/models/tiny-trained"


def _engine(model, **kw):
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine

    return LLMEngine(model, EngineConfig(**kw))


def measure_ttft(model, prompt_len: int, repeats: int, eagle: str, k: int, max_model_len: int) -> dict:
    from workers.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
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


def decode_prompts(num_prompts: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """Windows of the train-tiny held-out split (byte ids), evenly spaced."""
    from workers.train.train_tiny import load_corpus

    _, hold = load_corpus(seed=0)
    step = (len(hold) - prompt_len) // num_prompts
    return [[t % vocab_size for t in hold[i * step : i * step + prompt_len]] for i in range(num_prompts)]


def measure_decode(model, k: int, num_tokens: int, eagle: str, prompts: list[list[int]], repeats: int) -> dict:
    """Greedy decode tok/s of k=0 vs k=k on the same prompts, interleaved; outputs must match."""
    from workers.engine.sampling_params import SamplingParams

    engines = {0: _engine(model, num_spec_tokens=0, max_model_len=4096),
               k: _engine(model, num_spec_tokens=k, eagle_mode=eagle, max_model_len=4096)}
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for engine in engines.values():  # warm-up: one-time init costs
        engine.generate([prompts[0][:32]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        cache_salt="warmup")
    decode_s, num_decoded = {0: 0.0, k: 0.0}, {0: 0, k: 0}
    proposed = accepted = 0
    outputs: dict[int, dict[int, list[int]]] = {0: {}, k: {}}
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            for kk in ((0, k) if (r + i) % 2 == 0 else (k, 0)):
                t0 = time.perf_counter()
                (out,) = engines[kk].generate([prompt], params, cache_salt=f"r{r}")
                decode_s[kk] += time.perf_counter() - t0 - out.ttft_s
                num_decoded[kk] += len(out.token_ids) - 1  # the first token comes with the prefill
                outputs[kk][i] = list(out.token_ids)
                if kk:
                    proposed += out.num_draft_proposed
                    accepted += out.num_draft_accepted
    plain, spec = num_decoded[0] / decode_s[0], num_decoded[k] / decode_s[k]
    return {"num_prompts": len(prompts), "prompt_len": len(prompts[0]), "decode_tokens": num_tokens,
            "repeats": repeats, "no_spec_tokens_per_s": round(plain, 1),
            f"mtp_k{k}_tokens_per_s": round(spec, 1), "speedup": round(spec / plain, 3),
            "mtp_acceptance": round(accepted / proposed, 3) if proposed else None,
            "mean_accepted_per_step": round(accepted / max(1, proposed) * k, 3),
            "outputs_equal": outputs[0] == outputs[k]}


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive, got {text!r}")
    return levels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__)
    p.add_argument("--model", default=TRAINED, help=f"checkpoint dir, or 'random' (default {TRAINED})")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-prompts", type=int, default=4)
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--eagle", default="lossless", choices=["drop", "lossless"])
    p.add_argument("--concurrency", type=_levels, default=None,
                   help="comma-separated levels, e.g. 1,4,16,32: output tokens/s per level (only this)")
    p.add_argument("--concurrency-spec-tokens", type=int, default=0,
                   help="MTP draft tokens per step in the concurrency runs (default 0: plain decode)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); 1 is steadier on a shared machine")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, args.threads or torch.get_num_threads()))
    from workers.model.loader import load_model

    with contextlib.ExitStack() as stack:  # a random checkpoint is removed once loaded
        try:
            model = load_model(stack.enter_context(random_checkpoint()) if args.model == "random" else args.model)
        except CheckpointError as exc:
            p.error(str(exc))
    report = {"model": args.model, "torch_threads": torch.get_num_threads()}
    if args.concurrency:
        from bench.concurrency import measure_concurrency

        prompts = decode_prompts(max(args.concurrency), args.decode_prompt_len, model.config.vocab_size)
        report["concurrency"] = measure_concurrency(model, args.concurrency, prompts, args.decode_tokens,
                                                    args.decode_repeats, args.concurrency_spec_tokens, args.eagle)
        print(json.dumps(report, indent=2))
        return 0
    report["resend"] = measure_ttft(model, args.prompt_len, args.repeats, args.eagle, 3, args.prompt_len + 64)
    prompts = decode_prompts(args.decode_prompts, args.decode_prompt_len, model.config.vocab_size)
    report["decode"] = measure_decode(model, 3, args.decode_tokens, args.eagle, prompts, args.decode_repeats)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
