"""`python -m bench.host_tier_ttft`: TTFT of one prompt served from each tier of one engine (issue 29).

One engine in this process (no Ray), with a host tier 8x its device budget; the device holds about
1.5 prompts of `--prompt-len` tokens. Each of `--repeats` rounds takes a fresh prompt P and serves it

    recompute   P cold: nothing cached (what it evicts to make room is demoted, as on any miss)
    device      P again at once: a device hit
    (flood)     other prompts of the same length until none of P's pages is left on the device
    host        P again: the same hit, every page of it promoted from the host tier first (the
                room it takes demotes the floods' pages, inside its TTFT)

so the three cases alternate within a round (load drift hits them alike) and each reports the
median over the rounds. Per case: median TTFT (arrival to first token, `RequestOutput.ttft_s`),
hit tokens, the hit's host tokens, prompt tokens computed, and the pages the host tier promoted
and demoted during that request (medians over rounds). The host case's output must equal the
cold one token for token (else the run fails). A warm-up round (not counted) pays one-time costs first.

The model is a random-weight checkpoint written at start-up from `--config` (default: the tiny
NemotronH, M-M*-M-M*- plus an MTP head) unless `--model DIR`, on `--device` (default cpu, with
`--threads` 1 torch thread). Prints a table with the ratios host / device and host / recompute,
and the engine's own price of the host case's copy (what its replica reports to the router, in
recomputed tokens) against the copy observed (host TTFT over device TTFT, at the rounds' recompute
rate); the report (with every round's row) goes to `--out` (default out/bench-host_tier_ttft.json).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time

import torch

from bench.random_checkpoint import CheckpointError, random_checkpoint
from bench.reports import default_report, write_report

DEFAULT_CONFIG = "configs/models/tiny-nemotron-h.yaml"
CASES = ("device", "host", "recompute")
MAX_FLOOD = 32  # prompts sent to push P off the device before giving up
HOST_OVER_DEVICE = 8  # the host tier's budget, in device budgets: it keeps every page of a round


def device_budget(model, prompt_len: int, num_spec_tokens: int, block_size: int = 16) -> tuple[int, float]:
    """(cache_memory_bytes, mamba_memory_fraction) giving 1.5x the KV blocks one max_model_len
    request needs (`workers.engine.pool_sizing.size_pools`) and 4 state pages over its need: a second
    prompt evicts most of the first."""
    kv_bytes = model.kv_bytes_per_block(block_size)
    if num_spec_tokens:
        kv_bytes += model.draft_kv_bytes_per_block(block_size)
    state_bytes = model.state_bytes_per_slot()
    num_blocks = (-(-(prompt_len + 64) // block_size) + 2) * 3 // 2
    num_pages = 8 + num_spec_tokens + 4
    kv, states = num_blocks * kv_bytes, num_pages * state_bytes + state_bytes // 2  # half a page: float slack
    return kv + states, states / (kv + states)


def make_engine(model, prompt_len: int, num_spec_tokens: int, eagle: str, device: str):
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine

    budget, fraction = device_budget(model, prompt_len, num_spec_tokens)
    config = EngineConfig(kernels="torch" if device == "cpu" else "auto", device=device, max_model_len=prompt_len + 64,
                          num_spec_tokens=num_spec_tokens, eagle_mode=eagle, cache_memory_bytes=budget,
                          mamba_memory_fraction=fraction, host_cache_bytes=HOST_OVER_DEVICE * budget)
    return LLMEngine(model, config)


def serve(engine, prompt: list[int]) -> tuple[dict, object]:
    """Serve `prompt` alone; (its row: TTFT, hits, host pages moved meanwhile, output tokens; its
    block hashes)."""
    from workers.engine.sampling_params import SamplingParams

    before = engine.cache.host_stats()
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    hashes = engine.requests[rid].hashes
    out = None
    while engine.has_unfinished():
        out = next((o for o in engine.step() if o.finished), out)
    after = engine.cache.host_stats()
    return {"ttft_s": out.ttft_s, "hit_tokens": out.num_cached_tokens, "host_hit_tokens": out.num_host_cached_tokens,
            "computed_tokens": out.num_computed_prompt_tokens,
            "promoted_pages": after["num_host_promoted_pages"] - before["num_host_promoted_pages"],
            "demoted_pages": after["num_host_demoted_pages"] - before["num_host_demoted_pages"],
            "token_ids": list(out.token_ids)}, hashes


def pages_on_device(engine, hashes) -> int:
    """Pages of every group cached on the device under one of the prompt's block hashes."""
    return sum(key in pool.cached for pool in engine.cache.pools for key in hashes.hashes)


def one_round(engine, prompt_len: int, seed: int) -> dict[str, dict]:
    """The three cases of one fresh prompt, in the only order that makes each one (module docstring)."""
    vocab = engine.vocab_size
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    recompute, hashes = serve(engine, prompt)
    device, _ = serve(engine, prompt)
    num_flood = 0
    while pages_on_device(engine, hashes):
        if num_flood == MAX_FLOOD:
            raise RuntimeError(f"{MAX_FLOOD} other prompts left {pages_on_device(engine, hashes)} of P's pages "
                               f"on the device")
        serve(engine, [rng.randrange(vocab) for _ in range(prompt_len)])
        num_flood += 1
    host, _ = serve(engine, prompt)
    if host["token_ids"] != recompute["token_ids"]:
        raise RuntimeError(f"round {seed}: the host hit's output differs from the cold one")
    host["num_flood_prompts"] = num_flood
    return {"recompute": recompute, "device": device, "host": host}


def summarize(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per case: the median of each field over the rounds (TTFT in ms)."""
    cases = {}
    for case in CASES:
        rows = [r[case] for r in rounds]
        med = {k: statistics.median(row[k] for row in rows)
               for k in ("hit_tokens", "host_hit_tokens", "computed_tokens", "promoted_pages", "demoted_pages")}
        cases[case] = {"ttft_ms": round(1e3 * statistics.median(row["ttft_s"] for row in rows), 2),
                       "ttft_ms_all": [round(1e3 * row["ttft_s"], 2) for row in rows], **med}
    return cases


def ratios(cases: dict[str, dict]) -> dict[str, float]:
    host = cases["host"]["ttft_ms"]
    return {"host_over_device": round(host / cases["device"]["ttft_ms"], 3),
            "host_over_recompute": round(host / cases["recompute"]["ttft_ms"], 3)}


def price_check(engine, cases: dict[str, dict]) -> dict | None:
    """The engine's own price of the host case's copy (`HostCopyPrice`, what its replica reports to
    the router), against what the rounds observed: the host case's TTFT over the device case's,
    in tokens recomputed at the recompute case's rate. None without a price or a usable rate."""
    price = engine.host_copy_price()
    host, device, cold = (cases[c] for c in ("host", "device", "recompute"))
    saved_ms = cold["ttft_ms"] - device["ttft_ms"]
    if price is None or saved_ms <= 0 or not device["hit_tokens"]:
        return None
    ms_per_token = saved_ms / device["hit_tokens"]
    return {"priced_tokens": round(price.of(int(host["host_hit_tokens"])), 2),
            "observed_tokens": round((host["ttft_ms"] - device["ttft_ms"]) / ms_per_token, 2),
            "copy_bytes_per_s": round(price.bytes_per_s), "fixed": round(price.fixed, 3),
            "per_token": round(price.per_token, 5)}


def table(report: dict) -> str:
    cases = report["cases"]
    lines = [f"{'case':<10} {'TTFT ms':>9} {'hit tok':>8} {'host hit':>8} {'computed':>8} {'promoted':>8} "
             f"{'demoted':>8}"]
    for case in CASES:
        c = cases[case]
        lines.append(f"{case:<10} {c['ttft_ms']:>9.2f} {c['hit_tokens']:>8g} {c['host_hit_tokens']:>8g} "
                     f"{c['computed_tokens']:>8g} {c['promoted_pages']:>8g} {c['demoted_pages']:>8g}")
    r = report["ratios"]
    lines.append(f"host / device {r['host_over_device']:.3f}   host / recompute {r['host_over_recompute']:.3f}   "
                 f"(medians of {report['repeats']}, prompt {report['prompt_len']} tokens, {report['device']})")
    check = report.get("price")
    if check is not None:
        lines.append(f"host copy priced {check['priced_tokens']:g} recomputed tokens by the engine "
                     f"({check['copy_bytes_per_s'] / 1e9:.2f} GB/s), observed {check['observed_tokens']:g}")
    return "\n".join(lines)


def measure(model, prompt_len: int, repeats: int, spec_tokens: int, eagle: str, device: str) -> dict:
    """The report of one run: a warm-up round, then `repeats` rounds on one engine."""
    engine = make_engine(model, prompt_len, spec_tokens, eagle, device)
    t0 = time.perf_counter()
    one_round(engine, prompt_len, seed=0)  # warm-up: one-time costs of each path
    rounds = [one_round(engine, prompt_len, seed=r) for r in range(1, repeats + 1)]
    cases = summarize(rounds)
    return {"device": device, "torch_threads": torch.get_num_threads(), "prompt_len": prompt_len, "repeats": repeats,
            "num_spec_tokens": spec_tokens, "eagle": eagle if spec_tokens else "off",
            "cache_memory_bytes": engine.config.cache_memory_bytes, "host_cache_bytes": engine.config.host_cache_bytes,
            "num_flood_prompts": [r["host"]["num_flood_prompts"] for r in rounds],
            "cases": cases, "ratios": ratios(cases), "price": price_check(engine, cases),
            "run_s": round(time.perf_counter() - t0, 1),
            "rounds": [{case: {k: v for k, v in r[case].items() if k != "token_ids"} for case in CASES}
                       for r in rounds]}


def _measure_at(model_dir: str, args: argparse.Namespace) -> dict:
    """`measure` on the checkpoint in `model_dir`, with `--threads` torch threads (restored after)."""
    from workers.model.loader import load_model

    model = load_model(model_dir, device=args.device, kernels="torch" if args.device == "cpu" else "auto")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return measure(model, args.prompt_len, args.repeats, args.spec_tokens, args.eagle, args.device)
    finally:
        torch.set_num_threads(threads)  # as it was (a caller in the same process, e.g. a test session)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_tier_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: a random one from --config)")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5, help="rounds; each case reports their median")
    p.add_argument("--spec-tokens", type=int, default=0, help="MTP draft tokens per step (0: none)")
    p.add_argument("--eagle", choices=["drop", "lossless"], default="lossless")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (weights and every device pool)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: steady on a shared machine, where 2 threads on 2 busy "
                        "cores can be 10x slower)")
    p.add_argument("--out", default=default_report("host_tier_ttft"))
    args = p.parse_args(argv)
    if args.prompt_len < 65 or args.repeats < 1 or args.spec_tokens < 0 or args.threads < 1:
        p.error("--prompt-len must be >= 65 (a hit needs a 64-token Mamba page), --repeats and --threads >= 1, "
                "--spec-tokens >= 0")
    with contextlib.ExitStack() as stack:
        try:
            model_dir = args.model or stack.enter_context(random_checkpoint(args.config))
        except CheckpointError as exc:
            p.error(str(exc))
        report = {"model": args.model or args.config, **_measure_at(model_dir, args)}
    print(f"report: {write_report(args.out, report)}")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
