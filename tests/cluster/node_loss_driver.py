"""A hybridserve cluster on the bed that loses a host (`tests/cluster/test_node_loss.py`): the front
door runs here, inside host 0's namespace, with its controller and cache service; 3 replicas, one
per host (`ReplicaSet.spread`), autoscaled within 3..4. One JSON line per phase on stdout; between
phases it waits for a line on stdin, while the test kills or cuts a host:

    python -m tests.cluster.node_loss_driver HEAD NODE_IP MODEL_DIR

    -> {"replicas": {replica: host address}}   3 replicas up
    <- {"wave": K}                             wave K: its prompts run cold (a salt of their own:
    -> {"routed": {replica: n}}                no hit) for the reference, then again, all at once;
                                               the line goes out once every one is on a replica
    <- {"victims": [replica, ...]}             (the test has killed or cut their host)
    -> {"outputs": ..., "purge_s": ...}        every request's end, when the victims left the
                                               membership and the index, the replacements, and
                                               where every request was routed after the purge
    <- {"check": true}                         (the test has restored a cut link)
    -> {"after": ...}                          the wave's prompts once more (hits now), and the
                                               index checked against the live replicas' caches
    <- {"stop": true}
    -> {"stopped": true}
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tests.cluster.netbed_serve_driver import NAMESPACE, make_prompt
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

CONFIG = EngineConfig(kernels="torch", max_model_len=1024, cache_memory_bytes=64 * 2**20)
PARAMS = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)  # long enough to be cut mid-stream
NUM_PROMPTS = 9  # 3 per replica
PROMPT_LEN = 200
BOUND_S = 60.0  # purge / replacement / index consistency: a bound, never a measurement


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _read() -> dict:
    return json.loads(sys.stdin.readline())


def _cluster_config():
    from cluster.config import ClusterConfig

    # pings every 0.5 s, 2 missed 1 s pings purge: a lost host's replicas are out in ~3 s, well
    # before Ray itself calls the node dead; no scale-up on load: the count is the floor's alone
    return ClusterConfig(name=None, num_replicas=3, min_replicas=3, max_replicas=4, max_attempts=4,
                         health_interval_s=0.5, health_timeout_s=1.0, health_max_missed=2,
                         autoscale_interval_s=0.5, scale_up_queue_depth=1000.0)


def _routing_backend():
    from cluster.frontdoor.backend import ClusterBackend

    class RouteLog(ClusterBackend):
        """Every routing decision of this front door: (when, target)."""

        routes: list[tuple[float, str]] = []

        def on_routed(self, msg, decision, target: str) -> None:
            self.routes.append((time.monotonic(), target))

    return RouteLog


def _wait(pred, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > BOUND_S:
            raise TimeoutError(f"{what}: not within {BOUND_S:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def _hosts(backend) -> dict[str, str]:
    """Each replica's host address."""
    import ray

    node_address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return {r: node_address.get(rep.info.node_id, "?") for r in backend.replica_ids
            if (rep := backend.replicas.get(r)) is not None}


def _victims_now(backend, victims: set[str], where: dict[str, str]) -> dict:
    """The lost replicas' actors as the GCS has them, and whether Ray calls their host alive again."""
    import ray
    from ray._private.state import actors

    from cluster.ids import replica_actor_name

    names = {replica_actor_name(backend.name, v) for v in victims}
    addresses = {where[v] for v in victims}
    return {"victim_states": sorted(a["State"] for a in actors().values() if a["Name"] in names),
            "victim_hosts_alive": sorted(n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] in addresses)}


def _indexed(backend) -> set[str]:
    try:
        return set(backend.service_stats()["replicas"])
    except Exception:  # noqa: BLE001 - busy: asked again
        return {"?"}


def _run_all(backend, prompts: list[list[int]], salt: str | None) -> list:
    """Every prompt at once; each one's tokens or error."""
    def one(p):
        try:
            out, served = backend.generate(p, PARAMS, cache_salt=salt)
            return {"tokens": list(out.token_ids), "served": served}
        except Exception as exc:  # noqa: BLE001 - a lost request: reported, the test fails on it
            return {"error": f"{type(exc).__name__}: {exc}"}

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _wave(backend, k: int) -> None:
    prompts = [make_prompt(PROMPT_LEN, 100 * k + i) for i in range(NUM_PROMPTS)]
    cold = _run_all(backend, prompts, salt=f"cold-{k}")
    first = len(backend.routes)
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(_run_all(backend, prompts, None)))
    runner.start()
    _wait(lambda: len(backend.routes) - first >= NUM_PROMPTS, "every request routed")
    routed: dict[str, int] = {}
    for _, target in backend.routes[first:]:
        routed[target] = routed.get(target, 0) + 1
    num_retries_before = backend.num_retries
    where = _hosts(backend)
    _emit(routed=routed, hosts=where)
    t_kill = time.monotonic()  # the test loses the host now: times from here include its kill / cut
    victims = set(_read()["victims"])
    purge_s = time.monotonic() - t_kill
    purge_s += _wait(lambda: not victims & (set(backend.replica_ids) | _indexed(backend)), "victims purged")
    t_purged = time.monotonic()
    try:
        _wait(lambda: len(set(backend.replica_ids) - victims) >= 3, "replacements")
        replace_s = time.monotonic() - t_kill
    except TimeoutError:
        replace_s = None
    runner.join(BOUND_S)
    done_s = time.monotonic() - t_kill
    finished_routes = backend.routes[first:]
    same = [r.get("tokens") == c.get("tokens") and "error" not in c for r, c in zip(results, cold)]
    _emit(num_finished=len(results), outputs=same,
          errors=[r["error"] for r in results if "error" in r] + [c["error"] for c in cold if "error" in c],
          served=[r.get("served") for r in results], purge_s=purge_s, done_s=done_s, replace_s=replace_s,
          retries=backend.num_retries - num_retries_before, replicas=backend.replica_ids,
          indexed=sorted(_indexed(backend)), stats=backend.counters, hosts=_hosts(backend),
          routes_to_victims_after_kill=sum(1 for t, r in finished_routes if t > t_kill and r in victims),
          routes_to_victims_after_purge=sum(1 for t, r in finished_routes if t > t_purged and r in victims))
    _read()  # the test restores what it cut
    t_after = time.monotonic()
    again = _run_all(backend, prompts, None)
    problems: list[str] = []

    def consistent() -> bool:
        problems[:] = backend.index_problems()
        return not problems

    try:
        consistent_s = _wait(consistent, "index consistent")
    except TimeoutError:
        consistent_s = None
    _emit(after=[a.get("tokens") == c.get("tokens") for a, c in zip(again, cold)],
          **_victims_now(backend, victims, where),
          errors=[a["error"] for a in again if "error" in a], problems=problems, consistent_s=consistent_s,
          routes_to_victims=sum(1 for t, r in backend.routes if t > t_after and r in victims),
          replicas=backend.replica_ids, indexed=sorted(_indexed(backend)), victims=sorted(victims))


def serve(head: str, node_ip: str, model_dir: str) -> dict:
    import ray

    ray.init(address=head, _node_ip_address=node_ip, namespace=NAMESPACE, log_to_driver=False,
             configure_logging=False)
    backend = _routing_backend()(model_dir, CONFIG, _cluster_config())
    try:
        _emit(replicas=_hosts(backend))
        while "wave" in (line := _read()):
            _wave(backend, line["wave"])
    finally:
        backend.shutdown()
        ray.shutdown()
    return {"stopped": True}


if __name__ == "__main__":
    _emit(**serve(*sys.argv[1:4]))
