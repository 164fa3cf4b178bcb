"""A hybridserve cluster on a bed whose head keeps its GCS tables in Redis, serving steady greedy
traffic while the test kills the head's GCS and starts it again (`tests/cluster/test_gcs_restart.py`).
The front door, controller and cache service run here, in host 0's namespace; the head has no CPU,
so the replicas (half a CPU each) run on the worker hosts. One JSON line per phase on stdout; between
phases it waits for a line on stdin:

    python -m tests.cluster.gcs_restart_driver HEAD NODE_IP MODEL_DIR

    -> {"replicas": {replica: {"host", "pid"}}, "warm": {...}}  2 replicas up; a prefix served twice
                                                 (the second hits); every traffic prompt's cold output
    <- {"traffic": true}
    -> {"num_finished": n}                       clients running, n requests finished so far
    <- {"count": true}                           (the GCS is down) -> {"num_finished": n}, any number of times
    <- {"restarted": true}                       (the test has killed the GCS and started it again)
    -> {"resume_s": ..., "requests": {...}, ...} the control plane answers again (nodes, a named actor,
                                                 a fresh request), traffic stopped; every request's end;
                                                 the replicas' pids and the warm prefix once more; a
                                                 third replica started (a new actor and placement group)
    <- {"stop": true}
    -> {"stopped": true}

A client retries a request that failed with a retryable error (`ServerOverloadedError`, HTTP 503,
`ReplicaFailedError` among them); any other error, or a finished output other than the cold one,
is counted against the cluster.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from tests.cluster.netbed_serve_driver import NAMESPACE, make_prompt
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

CONFIG = EngineConfig(kernels="torch", max_model_len=1024, cache_memory_bytes=64 * 2**20)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPT_LEN = 200
WARM_LEN = 400
NUM_PROMPTS = 6
NUM_CLIENTS = 3
MAX_TRIES = 20
BOUND_S = 60.0  # resume bound: never a measurement


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _read() -> dict:
    return json.loads(sys.stdin.readline())


class Clients:
    """`NUM_CLIENTS` threads sending the traffic prompts round robin until stopped, each request
    retried on a retryable error; every request's end recorded."""

    def __init__(self, backend, prompts: list[list[int]], cold: list[list[int]]) -> None:
        self.backend, self.prompts, self.cold = backend, prompts, cold
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ends: list[dict] = []  # {"t", "tries", "ok", "wrong", "error", "retryable_errors"}
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(NUM_CLIENTS)]
        for t in self.threads:
            t.start()

    def _one(self, k: int) -> dict:
        from workers.engine.errors import ServerOverloadedError

        retryable: list[str] = []
        for tries in range(1, MAX_TRIES + 1):
            try:
                out, _ = self.backend.generate(self.prompts[k], PARAMS)
                return {"t": time.monotonic(), "tries": tries, "ok": True,
                        "wrong": list(out.token_ids) != self.cold[k], "retryable_errors": retryable}
            except ServerOverloadedError as exc:  # retryable (HTTP 503): the client tries again
                retryable.append(f"{type(exc).__name__}: {exc}"[:300])
                time.sleep(0.5)
            except Exception as exc:  # noqa: BLE001 - not retryable: counted against the cluster
                return {"t": time.monotonic(), "tries": tries, "ok": False, "wrong": False,
                        "error": f"{type(exc).__name__}: {exc}"[:500], "retryable_errors": retryable}
        return {"t": time.monotonic(), "tries": MAX_TRIES, "ok": False, "wrong": False,
                "error": "retried out", "retryable_errors": retryable}

    def _run(self, client: int) -> None:
        k = client
        while not self.stop.is_set():
            end = self._one(k % NUM_PROMPTS)
            with self.lock:
                self.ends.append(end)
            k += NUM_CLIENTS

    def num_finished(self) -> int:
        with self.lock:
            return sum(1 for e in self.ends if e["ok"])

    def finish(self) -> dict:
        self.stop.set()
        for t in self.threads:
            t.join(BOUND_S)
        ends = list(self.ends)
        return {"num_requests": len(ends), "num_finished": sum(e["ok"] for e in ends),
                "num_retried": sum(e["ok"] and e["tries"] > 1 for e in ends),
                "num_wrong": sum(e["wrong"] for e in ends), "num_hung": sum(t.is_alive() for t in self.threads),
                "errors": [e["error"] for e in ends if not e["ok"]],
                "retryable_errors": sorted({m for e in ends for m in e["retryable_errors"]})[:10]}


def _replicas(backend) -> dict[str, dict]:
    """Each replica's host address and its process id, asked of the replica itself."""
    import ray

    node_address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    out = {}
    for r in backend.replica_ids:
        rep = backend.replicas.get(r)
        pid = ray.get(rep.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        out[r] = {"host": node_address.get(rep.info.node_id, "?"), "pid": pid}
    return out


def _warm(backend, replica: str) -> dict:
    out, served = backend.generate(make_prompt(WARM_LEN, 7), PARAMS, replica_id=replica)
    return {"served": served, "num_cached_tokens": out.num_cached_tokens, "tokens": list(out.token_ids)}


def _control_plane_answers(backend) -> bool:
    """The GCS serves again: every node alive in its table, a named actor found through it."""
    import ray

    from cluster.ids import controller_name

    try:
        alive = sum(1 for n in ray.nodes() if n["Alive"])
        ray.get_actor(controller_name(backend.name), namespace=NAMESPACE)
        return alive == 3
    except Exception:  # noqa: BLE001 - the GCS is still coming back: asked again
        return False


def serve(head: str, node_ip: str, model_dir: str) -> dict:
    import ray

    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend

    ray.init(address=head, _node_ip_address=node_ip, namespace=NAMESPACE, log_to_driver=False,
             configure_logging=False)
    backend = ClusterBackend(model_dir, CONFIG, ClusterConfig(name=None, num_replicas=2, num_cpus_per_rank=0.5))
    try:
        replicas = _replicas(backend)
        holder = backend.replica_ids[0]
        warm = [_warm(backend, holder), _warm(backend, holder)]
        prompts = [make_prompt(PROMPT_LEN, 500 + i) for i in range(NUM_PROMPTS)]
        cold = [list(backend.generate(p, PARAMS, cache_salt="cold")[0].token_ids) for p in prompts]
        _emit(replicas=replicas, holder=holder, warm=warm)
        _read()
        clients = Clients(backend, prompts, cold)
        while clients.num_finished() < 2 * NUM_CLIENTS:
            time.sleep(0.05)
        _emit(num_finished=clients.num_finished())
        while "count" in _read():  # the GCS is down: the requests finished so far
            _emit(num_finished=clients.num_finished())
        t_restarted = time.monotonic()
        num_before = clients.num_finished()
        while not _control_plane_answers(backend):
            if time.monotonic() - t_restarted > BOUND_S:
                break
            time.sleep(0.1)
        control_s = time.monotonic() - t_restarted
        fresh = None
        try:
            fresh = list(backend.generate(make_prompt(PROMPT_LEN, 999), PARAMS)[0].token_ids)
        finally:
            resume_s = time.monotonic() - t_restarted
        while clients.num_finished() < num_before + 2 * NUM_CLIENTS and time.monotonic() - t_restarted < BOUND_S:
            time.sleep(0.05)
        requests = clients.finish()
        kept, warm_after = _replicas(backend), _warm(backend, holder)
        t_add = time.monotonic()  # a new replica: an actor and a placement group, created by the GCS
        added = backend.add_replicas(1)[0]
        added_tokens = list(backend.generate(prompts[0], PARAMS, replica_id=added)[0].token_ids)
        _emit(control_s=control_s, resume_s=resume_s, fresh_served=fresh is not None, requests=requests,
              finished_after_restart=clients.num_finished() - num_before, replicas=kept, warm=warm_after,
              added_s=time.monotonic() - t_add, added_same_tokens=added_tokens == cold[0],
              added_host=_replicas(backend)[added]["host"], stats=backend.counters)
        _read()
    finally:
        backend.shutdown()
        ray.shutdown()
    return {"stopped": True}


if __name__ == "__main__":
    _emit(**serve(*sys.argv[1:4]))
