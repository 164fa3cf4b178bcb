"""`python -m bench.host_overhead`: the host work of one decode step, measured without a GPU.

For k = 0 and k = 3 (MTP drafts) and C = 1, 16, 64 concurrent greedy requests, the engine is brought to a
steady decode (every request past its prefill, drafts in flight), then each of `--steps` decode steps is
counted (bench/host_counters.py: operator calls and would-be device synchronisations; see there for what
counts) and, in separate runs without the counters, timed on the host (`--threads`, default 1, torch intra-op
threads). Host ms is the median over `--runs` runs (fresh engines) of each run's median step time.

On a GPU every operator is a kernel launch or a host op and every sync stalls the host until the device
drains, so these counts are what makes a decode step host-bound there (the GPU engine issue: 240 launches
and ~26 syncs per step). With `--graphs on` (or `both`, the default) decode steps also go through the graph runner
(workers/model/decode_graphs.py) with each replay counted as one call: the host work per step when the decode
forward is a CUDA graph (the graph itself does not run here: its ops run eagerly, uncounted, so the run has
no host ms). The model is a random-weight checkpoint written at start-up from
`--config` (default: the tiny NemotronH, pattern M-M*-M-M*- plus an MTP head), unless `--model DIR`.
The report goes to `--out` (default out/host_overhead.json) and stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.host_counters import HostCounter
from bench.random_checkpoint import CheckpointError, random_checkpoint

DEFAULT_CONFIG = "configs/models/tiny-nemotron-h.yaml"
PROMPT_LEN = 32


class ReplayCountedAsOneCall:
    """The CPU stand-in for a CUDA graph in the counts: the captured forward runs (eagerly, so outputs
    are real) but a HostCounter counts each replay as ONE operator call and each capture likewise: what
    the host issues per step when the decode forward is a graph. Host ms are not meaningful with it."""

    name = "eager-replay counted as one call"

    def capture(self, fn):
        from workers.model.decode_graphs import EagerReplay

        counter = HostCounter.active
        if counter is None:
            replay, out = EagerReplay().capture(fn)
        else:
            with counter.as_one_call("graph_capture"):
                replay, out = EagerReplay().capture(fn)

        def replay_counted() -> None:
            active = HostCounter.active
            if active is None:
                return replay()
            with active.as_one_call("graph_replay"):
                replay()
        return replay_counted, out


def make_engine(model, concurrency: int, k: int, max_tokens: int, graphs: bool = False, **overrides):
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine

    config = EngineConfig(max_num_seqs=concurrency, num_spec_tokens=k, max_model_len=PROMPT_LEN + max_tokens + 32,
                          cache_memory_bytes=1024 * 2**20, mamba_memory_fraction=0.6, kernels="torch", **overrides)
    return LLMEngine(model, config, graph_backend=ReplayCountedAsOneCall() if graphs else None)


def steady_decode(model, concurrency: int, k: int, num_steps: int, seed: int, graphs: bool = False, **overrides):
    """An engine whose next `num_steps` steps are decode-only steps of `concurrency` requests."""
    from workers.engine.sampling_params import SamplingParams

    max_tokens = num_steps * (k + 1) + 16  # nobody finishes inside the measured window
    engine = make_engine(model, concurrency, k, max_tokens, graphs, **overrides)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(concurrency):
        engine.add_request([rng.randrange(3, model.config.vocab_size) for _ in range(PROMPT_LEN)], params)
    for _ in range(1000):
        engine.step()
        running = engine.scheduler.running
        if not engine.scheduler.waiting and len(running) == concurrency and not any(r.is_prefilling for r in running) \
                and all(len(r.output_token_ids) >= 3 for r in running):
            break
    else:
        raise RuntimeError("the engine did not reach a steady decode")
    return engine


def _decode_step(engine, concurrency: int) -> None:
    outputs = engine.step()
    if len(outputs) != concurrency or any(o.finished for o in outputs):
        raise RuntimeError(f"expected {concurrency} running decodes, got {len(outputs)} outputs")


def count_steps(model, concurrency: int, k: int, num_steps: int, graphs: bool = False, **overrides) -> list:
    engine = steady_decode(model, concurrency, k, num_steps, seed=concurrency * 10 + k, graphs=graphs, **overrides)
    per_step = []
    for _ in range(num_steps):
        with HostCounter() as counter:
            _decode_step(engine, concurrency)
        per_step.append(counter.counts())
    return per_step


def time_steps(model, concurrency: int, k: int, num_steps: int, runs: int, **overrides) -> float:
    """Median over runs of the median host ms per decode step."""
    medians = []
    for run in range(runs):
        engine = steady_decode(model, concurrency, k, num_steps, seed=run, **overrides)
        times = []
        for _ in range(num_steps):
            t0 = time.perf_counter()
            _decode_step(engine, concurrency)
            times.append(1e3 * (time.perf_counter() - t0))
        medians.append(statistics.median(times))
    return statistics.median(medians)


def measure(model, levels: list[int], spec_tokens: list[int], num_steps: int, runs: int, graphs: bool = False,
            **overrides) -> list[dict]:
    """One row per (k, C). `graphs`: decode steps through the graph runner, each replay counted as one
    call (ReplayCountedAsOneCall); no host ms then."""
    rows = []
    for k in spec_tokens:
        for c in levels:
            counts = count_steps(model, c, k, num_steps, graphs, **overrides)
            sites: dict[str, int] = {}
            for step in counts:
                for what, n in step.sync_sites:
                    sites[what] = sites.get(what, 0) + n
            timed = runs and not graphs
            rows.append({
                "num_spec_tokens": k, "concurrency": c, "steps": num_steps, "decode_graphs": graphs,
                "ops_per_step": round(statistics.mean(s.num_ops for s in counts), 1),
                "syncs_per_step_max": max(s.num_syncs for s in counts),
                "syncs_per_step_mean": round(statistics.mean(s.num_syncs for s in counts), 2),
                "sync_sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])),
                "host_ms_per_step": round(time_steps(model, c, k, num_steps, runs, **overrides), 3) if timed else None,
            })
    return rows


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: a random one from --config)")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--concurrency", type=_ints, default=[1, 16, 64])
    p.add_argument("--spec-tokens", type=_ints, default=[0, 3])
    p.add_argument("--steps", type=int, default=8, help="decode steps counted / timed per run")
    p.add_argument("--runs", type=int, default=3, help="timed runs per point (0: counts only)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--graphs", choices=["off", "on", "both"], default="both",
                   help="decode steps eager, through the graph runner (a replay counted as one call), or both")
    p.add_argument("--out", default="out/host_overhead.json")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.steps < 1 or args.runs < 0 or args.threads < 1:
        p.error("concurrency, steps and threads must be >= 1, runs >= 0")
    torch.set_num_threads(args.threads)
    from workers.model.loader import load_model

    with contextlib.ExitStack() as stack:  # a random checkpoint is removed once loaded
        try:
            model = load_model(args.model or stack.enter_context(random_checkpoint(args.config)), kernels="torch")
        except CheckpointError as exc:
            p.error(str(exc))
    report = {"model": args.model or args.config, "torch_threads": args.threads, "prompt_len": PROMPT_LEN,
              "points": [row for graphs in {"off": [False], "on": [True], "both": [False, True]}[args.graphs]
                         for row in measure(model, args.concurrency, args.spec_tokens, args.steps, args.runs, graphs)]}
    text = json.dumps(report, indent=2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
