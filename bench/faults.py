"""`python -m bench.faults`: fault injection on a simulated 2-node Ray cluster under loadtest traffic.

A `ray.cluster_utils.Cluster` of two loopback nodes, the tiny trained model, two replicas (one per
node) behind `ClusterBackend` and the HTTP front end on 127.0.0.1. Cold reference outputs come
first (each prompt once, under a salt of its own, so nothing hits). Then, per scenario, a seeded
`resend` workload (greedy) runs over HTTP and the fault is injected mid-traffic:

    drop_events         a replica loses its next batch of cache events (the index sees the gap, resyncs)
    reorder_events      a replica's next batch arrives out of order (same)
    corrupt_transfer    one byte of a transferred page flips on the wire (the checksum refuses it,
                        the request recomputes); forced requests make the transfers happen
    evict_while_routed  the holder evicts its pages between routing and transfer / serving
    kill_cache_service  the cache-service actor is killed (load-only routing, then a rebuilt index)
    kill_replica        a replica actor is killed (its requests resume on the other one)
    kill_tp_rank        (replicas with tp_size 2) one TPWorker actor is killed; its replica reports
                        itself unhealthy, is purged and stopped, its requests resume elsewhere

The two kills also start three probe requests on the victim and wait until each has streamed a
token before killing it: a long greedy one (must finish with its cold output, resumed elsewhere),
a seeded sampled one (must finish: seeded outputs are deterministic) and an unseeded sampled one,
the one documented case that may end with a retryable error (its tokens already went out and
cannot be regenerated).

Per scenario: requests sent, completed, retryable errors (429/503, or a stream error saying
"retry"), how many of those are the documented case (every other one is a failure: every greedy
request must finish with status 200 and its cold output), lost (neither: must be 0), outputs
differing from cold (must be 0), and recovery seconds: from the fault taking effect until
`ClusterBackend.index_problems()` is empty (no stale or dead entry; every live replica's index
entries equal its own cache). JSON report too.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from bench.fault_env import Env, FaultConfig, ScenarioResult
from bench.fault_probes import Probe, finish_probes, probe_reference, start_probes
from bench.reports import default_report, write_report

TINY_TRAINED = str(Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny-trained")
SCENARIOS = ("drop_events", "reorder_events", "corrupt_transfer", "evict_while_routed", "kill_cache_service",
             "kill_replica", "kill_tp_rank")


# ---- the cluster ---------------------------------------------------------------------------------
@contextlib.contextmanager
def two_node_cluster(num_cpus_per_node: int = 1):
    """Two Ray nodes on loopback (driver connected); RAY_TMPDIR short for unix socket paths."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rf", dir="/tmp"))
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": num_cpus_per_node, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    cluster.add_node(num_cpus=num_cpus_per_node, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def serving(backend, model_dir: str):
    """The OpenAI front end over `backend` under uvicorn on 127.0.0.1 (a context manager; yields its URL)."""
    from cluster.http.app import create_app
    from cluster.http.local_server import serve_app
    from cluster.text.tokenizer import load_tokenizer

    return serve_app(create_app(backend, Path(model_dir).name, tokenizer=load_tokenizer(model_dir)))


def make_backend(model_dir: str, config: FaultConfig, tp_size: int = 1, num_replicas: int = 2):
    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend
    from workers.engine.config import EngineConfig

    engine = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=config.cache_memory_bytes)
    from bench.fault_doubles import FaultyReplica

    return ClusterBackend(model_dir, engine, ClusterConfig(name=None, num_replicas=num_replicas, tp_size=tp_size,
                                                           transfer_timeout_s=30.0), replica_cls=FaultyReplica)


def workload_config(config: FaultConfig, salt: str):
    from cluster.loadtest import WorkloadConfig

    return WorkloadConfig("resend", num_prompts=config.num_prompts, prompt_len=config.prompt_len,
                          max_tokens=config.max_tokens, concurrency=config.concurrency, seed=config.seed,
                          salt=salt, timeout_s=120.0)


def make_env(backend, url: str, config: FaultConfig) -> Env:
    """Prompts of the workload and their cold outputs (each under its own salt: no hits)."""
    from cluster.loadtest import build_workload

    specs = build_workload(workload_config(config, "x")).specs[: config.num_prompts]
    prompts = [list(s.prompt) for s in specs]
    env = Env(backend, url, config, prompts, [])
    env.cold = [list(backend.generate(p, env.params(), cache_salt=f"cold-{i}")[0].token_ids)
                for i, p in enumerate(prompts)]
    return env


# ---- one scenario ------------------------------------------------------------------------------------
def _retryable(status: str, error: str | None) -> bool:
    return status in ("429", "503") or (status == "stream_error" and "retry" in (error or "").lower())


def _score(result: ScenarioResult, env: Env, outputs: list[tuple[int, str, str | None, list[int]]]) -> None:
    """outputs: (prompt index, status, error, token ids) per request."""
    for i, status, error, tokens in outputs:
        result.sent += 1
        if status == "200":
            result.completed += 1
            result.differing += tokens != env.cold[i]
        elif _retryable(status, error):
            result.retryable_errors += 1
        else:
            result.lost += 1
            result.details.setdefault("errors", []).append(f"{status}: {(error or '')[:160]}")


def _holder(env: Env, prompt: list[int], salt: str) -> str:
    """Warm `prompt` under `salt` (setup, not counted) and return the replica holding it."""
    return env.backend.generate(prompt, env.params(), cache_salt=salt)[1]


def _forced(env: Env, salt: str) -> list:
    """Each prompt forced to a replica that does not hold it (its pages move there first)."""
    out = []
    for i, p in enumerate(env.prompts):
        holder = _holder(env, p, salt)
        other = next((r for r in env.backend.replica_ids if r != holder), holder)
        try:
            res, _ = env.backend.generate(p, env.params(), cache_salt=salt, replica_id=other)
            out.append((i, "200", None, list(res.token_ids)))
        except Exception as exc:  # noqa: BLE001 - scored as an error
            out.append((i, "error", f"{type(exc).__name__}: {exc}", []))
    return out


def _actor(env: Env, replica_id: str):
    return env.backend.replicas.get(replica_id).actor


def run_scenario(env: Env, name: str) -> ScenarioResult:
    """Traffic over HTTP with `name`'s fault injected `fault_after_s` in; scored against cold."""
    import ray

    from bench.fault_doubles import kill_cache_service, kill_replica
    from cluster.loadtest import run_workload

    backend, config = env.backend, env.config
    salt = f"{name}-{time.time_ns()}-"
    wl = workload_config(config, salt)
    prompt_salt = f"{salt}resend"
    result = ScenarioResult(name)
    before = dict(backend.counters)
    records: list = []
    extra: list = []  # forced requests, scored like the traffic
    traffic = threading.Thread(target=lambda: records.extend(
        run_workload(env.url, wl, show_progress=False).records))
    fired: list[float] = []
    victims = backend.replica_ids
    if name in ("corrupt_transfer", "evict_while_routed"):  # holders must exist before the fault
        for p in env.prompts:
            _holder(env, p, prompt_salt)
    kills = name in ("kill_replica", "kill_tp_rank")
    probe_expect = probe_reference(env, salt) if kills else None
    probes: list[Probe] = []
    traffic.start()
    deadline = time.monotonic() + 30
    while not backend.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(config.fault_after_s)
    if name in ("drop_events", "reorder_events"):
        victim = victims[0]
        ray.get(_actor(env, victim).inject_event_fault.remote(name.split("_")[0]))
        # the fault fires on the victim's next event batch: if the traffic has moved elsewhere,
        # give the victim one request of its own (scored like the rest) so that it does fire
        time.sleep(2.0)
        if ray.get(_actor(env, victim).fault_time.remote(), timeout=10) is None:
            i = 0
            res, _ = backend.generate(env.prompts[i], env.params(), cache_salt=f"{prompt_salt}-fire",
                                      replica_id=victim)
            extra = [(i, "200", None, list(res.token_ids))]
    elif name == "corrupt_transfer":
        ray.get([_actor(env, r).inject_transfer_fault.remote() for r in victims])
        extra = _forced(env, prompt_salt)
    elif name == "evict_while_routed":
        evicted: list[int] = []

        def evict_holder(msg, decision, target) -> None:
            if decision is None or len(evicted) >= 4:
                return
            best = max(decision.estimates, key=lambda e: e.hit_tokens, default=None)
            if best is not None and best.hit_tokens > 0:
                evicted.append(ray.get(_actor(env, best.replica_id).evict_cached.remote()))
                fired.append(time.time())

        backend.on_routed = evict_holder
        extra = _forced(env, prompt_salt)
    elif name == "kill_cache_service":
        fired.append(time.time())
        kill_cache_service(backend)
    elif name == "kill_replica":
        probes = start_probes(env, victims[0], salt, probe_expect)
        fired.append(time.time())
        kill_replica(backend, victims[0])
    elif name == "kill_tp_rank":
        workers = ray.get(_actor(env, victims[0]).tp_workers.remote())
        probes = start_probes(env, victims[0], salt, probe_expect)
        fired.append(time.time())
        ray.kill(workers[0], no_restart=True)
    result.recovery_s = _recovery(env, name, victims, fired)
    traffic.join(timeout=300)
    vars(backend).pop("on_routed", None)  # back to the class's no-op seam
    _score(result, env, [(int(r.group[1:]), r.status, r.error, r.output_token_ids) for r in records] + extra)
    finish_probes(result, probes)
    after = backend.counters
    result.details.update({k: after[k] - before[k] for k in after if after[k] != before[k]})
    if name == "evict_while_routed":
        result.details["pages_evicted"] = sum(evicted)
    result.details["replicas_after"] = backend.replica_ids
    return result


def _fault_time(env: Env, name: str, victims: list[str], fired: list[float]) -> float | None:
    import ray

    if fired:
        return fired[0]
    times = []
    for r in victims:
        rep = env.backend.replicas.get(r)
        if rep is not None:
            with contextlib.suppress(Exception):
                times.append(ray.get(rep.actor.fault_time.remote(), timeout=10))
    times = [t for t in times if t is not None]
    return min(times) if times else None


def _recovery(env: Env, name: str, victims: list[str], fired: list[float]) -> float | None:
    """Seconds from the fault taking effect until the index is consistent; None past the timeout."""
    deadline = time.time() + env.config.recovery_timeout_s
    while time.time() < deadline:
        t_fault = _fault_time(env, name, victims, fired)
        if t_fault is not None and not env.backend.index_problems():
            return round(max(0.0, time.time() - t_fault), 2)
        time.sleep(0.1)
    logging.getLogger(__name__).warning("%s: index not consistent after %.0fs: %s", name,
                                        env.config.recovery_timeout_s, env.backend.index_problems())
    return None


# ---- all of it ------------------------------------------------------------------------------------------
def run_all(config: FaultConfig, scenarios=SCENARIOS, model_dir: str = TINY_TRAINED) -> list[ScenarioResult]:
    """Scenarios on TP=1 replicas first (kill_replica last of those), then kill_tp_rank on TP=2."""
    with two_node_cluster():
        return run_scenarios(config, scenarios, model_dir)


def run_scenarios(config: FaultConfig, scenarios=SCENARIOS, model_dir: str = TINY_TRAINED) -> list[ScenarioResult]:
    """`run_all` on the Ray cluster this process is connected to."""
    results = []
    plain = [s for s in scenarios if s != "kill_tp_rank"]
    for tp_size, names in ((1, plain), (2, [s for s in scenarios if s == "kill_tp_rank"])):
        if not names:
            continue
        backend = make_backend(model_dir, config, tp_size=tp_size)
        try:
            with serving(backend, model_dir) as url:
                env = make_env(backend, url, config)
                for name in names:
                    t0 = time.perf_counter()
                    res = run_scenario(env, name)
                    res.details["wall_s"] = round(time.perf_counter() - t0, 1)
                    res.details["tp_size"] = tp_size
                    results.append(res)
        finally:
            backend.shutdown()
    return results


def format_table(results: list[ScenarioResult]) -> str:
    head = (f"{'scenario':<20}{'sent':>6}{'done':>6}{'retry':>7}{'(documented)':>14}{'lost':>6}{'differ':>8}"
            f"{'recovery s':>12}")
    rows = [head, "-" * len(head)]
    for r in results:
        rec = "n/a" if r.recovery_s is None else f"{r.recovery_s:.2f}"
        rows.append(f"{r.name:<20}{r.sent:>6}{r.completed:>6}{r.retryable_errors:>7}{r.documented_retryable:>14}"
                    f"{r.lost:>6}{r.differing:>8}{rec:>12}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    p.add_argument("--num-prompts", type=int, default=FaultConfig.num_prompts)
    p.add_argument("--prompt-len", type=int, default=FaultConfig.prompt_len)
    p.add_argument("--model", default=TINY_TRAINED)
    p.add_argument("--out", default=default_report("faults"), help="JSON report path (default: under out/)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    names = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    config = FaultConfig(num_prompts=args.num_prompts, prompt_len=args.prompt_len)
    t0 = time.perf_counter()
    results = run_all(config, names, args.model)
    print(format_table(results))
    report = {"config": asdict(config), "wall_s": round(time.perf_counter() - t0, 1),
              "scenarios": [asdict(r) | {"ok": r.ok} for r in results]}
    write_report(args.out, report)
    print(f"report: {args.out} ({report['wall_s']}s)")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
