"""`python -m bench.eviction`: what one eviction decision costs, and what the policy costs the simulator.

    decision   per policy and pool size n (retained states): the time of one decision as a Mamba
               pool makes it under pressure: a request admitted (tick), a victim named and removed,
               the new state stored, a retained state restored. `value` and `lru` at 10k and 1M
               states (value keeps a heap: O(log n); the ratio 1M / 10k shows it); `marconi` is
               O(n) as published (its normalization reads every candidate), timed at 10k and 100k.
               Mean, median, p99 and max per decision: value's mean includes its rare O(n)
               re-keyings (tau doubled or halved), its median the heap alone. `value:auto` also
               remembers each victim as a ghost and regrets it at the next request (its T moves).
    simulator  `hybridserve simulate` on the shipped trace (R=1, 96 GiB, dense retention: the most
               evictions) with each policy: simulated requests per CPU second, and value's as a
               ratio of lru's (target >= 0.8); and value with placement by expected value
               (value:3e8, a dynamic program per request) as a ratio of lru on `latest` (the
               positions placement adds to); value:auto's rate as a ratio of lru's.

Prints a table and writes JSON (--out). Timings are ratios within one run; the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from cache_service.eviction import make_eviction
from cache_service.trace_sim.cli import DEFAULT_TRACE
from cache_service.trace_sim.config import load_cost_model, load_layout
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.trace import load_trace


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def decision_cost(policy_name: str, num_states: int, num_decisions: int, seed: int = 0) -> dict:
    """Microseconds per decision with `num_states` retained, after filling the policy and a warm-up."""
    rng = random.Random(seed)
    policy = make_eviction(policy_name)
    live = []
    for i in range(num_states):
        if i % 10 == 0:
            policy.tick()
        policy.stored(key(i), 64 * rng.randrange(1, 512), 0)
        live.append(key(i))
    index = {k: j for j, k in enumerate(live)}
    free = index.__contains__
    next_key = num_states

    times: list[float] = []

    def decide(count: int) -> None:
        nonlocal next_key
        clock = time.perf_counter
        for _ in range(count):
            start = clock()
            policy.tick()
            victim = policy.victim(free)
            policy.evicted(victim)
            policy.removed(victim)
            policy.missed((victim, key(next_key - 1)), 0)  # the next request passes it (value:auto regrets)
            j = index.pop(victim)
            new = key(next_key)
            next_key += 1
            live[j] = new
            index[new] = j
            policy.stored(new, 64 * rng.randrange(1, 512), 0)
            policy.used(live[rng.randrange(num_states)], True, 64)
            times.append(clock() - start)

    decide(min(num_decisions, 1000))  # warm-up: value's tau settles from its prior (one re-keying)
    times.clear()
    decide(num_decisions)
    ordered = sorted(times)
    return {"policy": policy_name, "num_states": num_states, "num_decisions": num_decisions,
            "us_per_decision": sum(times) / num_decisions * 1e6,
            "us_median": ordered[len(ordered) // 2] * 1e6,
            "us_p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
            "us_max": ordered[-1] * 1e6}


def simulator_rate(eviction: str, limit: int, retention: str = "dense") -> dict:
    settings = SimSettings(load_layout("nemotron-nano-9b-v2"), load_cost_model("gpu"), 1, "hybrid",
                           96 * 2**30, retention=retention, eviction=eviction)
    requests = load_trace(DEFAULT_TRACE, limit)
    sim = ClusterSim(settings)
    cpu = time.process_time()
    records = sim.run(requests)
    cpu = time.process_time() - cpu
    num_input = sum(r.input_tokens for r in records)
    return {"eviction": eviction, "retention": retention, "num_requests": len(records), "cpu_s": cpu,
            "requests_per_cpu_s": len(records) / cpu if cpu else 0.0,
            "hit_rate": sum(r.hit_tokens for r in records) / num_input if num_input else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eviction", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,1000000", help="pool sizes for lru and value")
    p.add_argument("--marconi-sizes", default="10000,100000")
    p.add_argument("--decisions", type=int, default=20000)
    p.add_argument("--marconi-decisions", type=int, default=200)
    p.add_argument("--sim-requests", type=int, default=1000, help="trace requests per simulator run (0: skip)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = [decision_cost(name, n, args.decisions) for name in ("lru", "value", "value:auto") for n in sizes]
    rows += [decision_cost("marconi", int(n), args.marconi_decisions) for n in args.marconi_sizes.split(",")]
    out: dict = {"decisions": rows}
    for name in ("lru", "value", "value:auto", "marconi"):
        mine = [r for r in rows if r["policy"] == name]
        if len(mine) > 1:
            out[f"{name}_growth"] = mine[-1]["us_per_decision"] / mine[0]["us_per_decision"]
            out[f"{name}_median_growth"] = mine[-1]["us_median"] / mine[0]["us_median"]
    print(f"{'policy':10} {'states':>9} {'us mean':>10} {'median':>8} {'p99':>8} {'max':>10}", file=sys.stderr)
    for r in rows:
        print(f"{r['policy']:10} {r['num_states']:>9} {r['us_per_decision']:>10.2f} {r['us_median']:>8.2f} "
              f"{r['us_p99']:>8.2f} {r['us_max']:>10.0f}", file=sys.stderr)
    if args.sim_requests:
        sims = [simulator_rate(name, args.sim_requests) for name in ("lru", "value")]
        sims += [simulator_rate("lru", args.sim_requests, "latest"),
                 simulator_rate("value", args.sim_requests, "value:3e8"),
                 simulator_rate("value:auto", args.sim_requests)]
        out["simulator"] = sims
        out["simulator_value_over_lru"] = sims[1]["requests_per_cpu_s"] / sims[0]["requests_per_cpu_s"]
        out["simulator_placed_over_lru"] = sims[3]["requests_per_cpu_s"] / sims[2]["requests_per_cpu_s"]
        out["simulator_auto_over_lru"] = sims[4]["requests_per_cpu_s"] / sims[0]["requests_per_cpu_s"]
        print(f"simulator: value {sims[1]['requests_per_cpu_s']:.0f} req/cpu-s, lru "
              f"{sims[0]['requests_per_cpu_s']:.0f}: ratio {out['simulator_value_over_lru']:.2f}; value with "
              f"placement (value:3e8) {sims[3]['requests_per_cpu_s']:.0f}, lru on latest "
              f"{sims[2]['requests_per_cpu_s']:.0f}: ratio {out['simulator_placed_over_lru']:.2f}; value:auto "
              f"{sims[4]['requests_per_cpu_s']:.0f}: ratio {out['simulator_auto_over_lru']:.2f}", file=sys.stderr)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
