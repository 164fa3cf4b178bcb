"""The chaos soak's driver (`bench.chaos` starts it inside host 0 of the multi-host bed):

    python -m bench.chaos_driver HEAD NODE_IP MODEL_DIR SEED CONCURRENCY TP_SIZE

It starts the cluster on the bed's Ray (2 replicas of `bench.fault_doubles.FaultyReplica`, spread
over the hosts; controller and cache service here), front door A in this process and front door B
as a `python -m cluster.serve` child attached by name, both behind HTTP on loopback; then greedy
traffic over HTTP (`bench.chaos_traffic`). JSON lines both ways (one command in, one answer out):

    -> {"ready": ..., "replicas": {id: host address}}      after the cold references
    <- {"cmd": "fault", "name": NAME}   inject a fault done from here (`DRIVER_FAULTS`)
    -> {"fired": t, "victim": ...}
    <- {"cmd": "recover", "timeout_s": S}  wait for a clean cluster: every replica serving, the
    -> {"recovered": s | null, ...}         index equal to the replicas' caches, both doors answering
    <- {"cmd": "where"}                  the replicas and their hosts now
    <- {"cmd": "stop"}
    -> {"records": [...], "counters": {...}}  every request's outcome; the cluster stopped

Faults from the bed itself (a slow link, a host lost, the GCS restarted) are `bench.chaos`'s.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.chaos_traffic import MAX_TOKENS, Traffic, cold_outputs, make_prompts
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.transfer_channel import free_port

CONFIG = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=64 * 2**20)
DRIVER_FAULTS = ("kill_replica", "kill_tp_rank", "kill_cache_service", "kill_controller", "kill_frontdoor",
                 "drop_events", "reorder_events", "corrupt_transfer")
REPLICA_FAULTS = ("kill_replica", "kill_tp_rank", "drop_events", "reorder_events")  # aimed at one replica
CLUSTER_NAME = "chaos"
NUM_REPLICAS = 2
log = logging.getLogger("bench.chaos_driver")


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


class Driver:
    def __init__(self, head: str, node_ip: str, model_dir: str, seed: int, concurrency: int,
                 tp_size: int = 1) -> None:
        import ray

        from bench.fault_doubles import FaultyReplica
        from cluster.config import ClusterConfig
        from cluster.control.ray_cluster import NAMESPACE
        from cluster.frontdoor.backend import ClusterBackend
        from cluster.http.app import create_app
        from cluster.http.local_server import serve_app
        from cluster.text.tokenizer import load_tokenizer

        ray.init(address=head, _node_ip_address=node_ip, namespace=NAMESPACE, log_to_driver=False,
                 configure_logging=False)
        self.head, self.node_ip, self.model_dir, self.seed, self.tp_size = head, node_ip, model_dir, seed, tp_size
        self.backend = ClusterBackend(model_dir, CONFIG, ClusterConfig(
            name=CLUSTER_NAME, num_replicas=NUM_REPLICAS, tp_size=tp_size, transfer_timeout_s=30.0,
            health_interval_s=1.0, health_timeout_s=5.0, health_max_missed=2), replica_cls=FaultyReplica)
        self._server = serve_app(create_app(self.backend, Path(model_dir).name, tokenizer=load_tokenizer(model_dir)))
        url_a = self._server.__enter__()
        self.door_b: subprocess.Popen | None = None
        self.port_b = free_port()
        self._start_door_b()
        self.prompts = make_prompts(seed)
        cold = cold_outputs(url_a, Path(model_dir).name, self.prompts)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        cold_ids = [list(self.backend.generate(p, params, cache_salt=f"cold-ids-{i}")[0].token_ids)
                    for i, p in enumerate(self.prompts)]
        self.traffic = Traffic([url_a, f"http://127.0.0.1:{self.port_b}"], Path(model_dir).name, self.prompts,
                               cold, cold_ids, concurrency, seed)

    # ---- front door B ---------------------------------------------------------------------------
    def _start_door_b(self, timeout_s: float = 120.0) -> None:
        sets = [f"cluster.ray_address={self.head}", f"cluster.name={CLUSTER_NAME}",
                f"cluster.tp_size={self.tp_size}",
                f"cluster.node_ip_address={self.node_ip}", "engine.kernels=torch",
                f"engine.max_model_len={CONFIG.max_model_len}",
                f"engine.cache_memory_bytes={CONFIG.cache_memory_bytes}"]
        argv = [sys.executable, "-m", "cluster.serve", self.model_dir, "--host", "127.0.0.1", "--port",
                str(self.port_b), *(a for kv in sets for a in ("--set", kv))]
        self.door_b = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(os.devnull, "w"),
                                       start_new_session=True)
        if not _wait_healthy(f"http://127.0.0.1:{self.port_b}", timeout_s):
            raise RuntimeError(f"front door B did not answer on port {self.port_b} within {timeout_s:.0f} s")

    def _door_b_healthy(self) -> bool:
        return self.door_b is not None and self.door_b.poll() is None and _wait_healthy(
            f"http://127.0.0.1:{self.port_b}", 0.5)

    # ---- faults ---------------------------------------------------------------------------------
    def fault(self, name: str) -> dict:
        import ray

        from bench.fault_doubles import kill_cache_service, kill_controller, kill_replica

        b = self.backend
        victim = b.replica_ids[self.traffic.rng_pick(len(b.replica_ids))] if b.replica_ids else None
        fired = time.time()
        if name == "kill_replica":
            kill_replica(b, victim)
        elif name == "kill_tp_rank":  # rank 1 of a TP=2 replica: the replica reports the loss and is replaced
            workers = ray.get(b.replicas.get(victim).actor.tp_workers.remote(), timeout=30)
            if not workers:
                raise ValueError("kill_tp_rank needs replicas with tp_size >= 2 (bench.chaos --tp-size 2)")
            ray.kill(workers[0], no_restart=True)
        elif name == "kill_cache_service":
            kill_cache_service(b)
        elif name == "kill_controller":
            kill_controller(b)
        elif name == "kill_frontdoor":
            os.killpg(self.door_b.pid, signal.SIGKILL)
            self.door_b.wait()
            self._start_door_b()  # an operator's supervisor (systemd, Kubernetes) starts it again
        elif name in ("drop_events", "reorder_events"):
            actor = b.replicas.get(victim).actor
            ray.get(actor.inject_event_fault.remote(name.split("_")[0]), timeout=30)
            took = self._await_fired(actor, victim, since=fired)
            if took is None:  # scored as not recovered: a fault that never fired tested nothing
                return {"fired": fired, "victim": victim, "not_fired": True}
            fired = took
        elif name == "corrupt_transfer":
            ray.get([b.replicas.get(r).actor.inject_transfer_fault.remote() for r in b.replica_ids], timeout=30)
            self.traffic.forced_moves(b)  # forced requests: pages move, one of them corrupt
        else:
            raise ValueError(f"unknown driver fault {name!r}; choose from {', '.join(DRIVER_FAULTS)}")
        return {"fired": fired, **({"victim": victim} if name in REPLICA_FAULTS else {})}

    def _await_fired(self, actor, victim: str, since: float, wait_s: float = 5.0, tries: int = 3) -> float | None:
        """When the event fault took effect (on the victim's next non-empty event batch): traffic's
        own, else a request of its own on the victim under a fresh salt (new blocks, so events; the
        traffic's prompts are all cached after a while); None if it never did. Only a time after
        `since` counts: the actor keeps the time of its earlier faults (a corrupted transfer too)."""
        import ray

        for attempt in range(tries + 1):
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if (t := ray.get(actor.fault_time.remote(), timeout=30)) is not None and t >= since:
                    return t
                time.sleep(0.1)
            if attempt < tries:
                self.traffic.forced_on(self.backend, victim)
        return None

    def where(self) -> dict:
        """Each replica's host address, from the controller (retried while it restarts)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                self.backend.replicas.refresh()
                break
            except Exception:  # noqa: BLE001 - a restarting controller or GCS: ask again
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        return {r: self.backend.replicas.get(r).info.node_ip for r in self.backend.replica_ids}

    def recover(self, timeout_s: float) -> dict:
        """Seconds until every replica serves (the count kept), the index equals the replicas'
        caches and both front doors answer; None past `timeout_s`."""
        t0 = time.time()
        problems: list[str] = []
        while time.time() - t0 < timeout_s:
            try:
                self.backend.replicas.refresh()
                n = len(self.backend.replica_ids)
                problems = self.backend.index_problems() if n == NUM_REPLICAS else [f"{n} replicas"]
            except Exception as exc:  # noqa: BLE001 - a restarting actor: not recovered yet
                problems = [f"{type(exc).__name__}: {exc}"[:200]]
            if not problems and self._door_b_healthy():
                elapsed = round(time.time() - t0, 2)
                try:  # the controller may restart between the check and this answer: check again
                    return {"recovered": elapsed, "replicas": self.where(), "counters": self.backend.counters}
                except Exception as exc:  # noqa: BLE001
                    problems = [f"{type(exc).__name__}: {exc}"[:200]]
            time.sleep(0.25)
        return {"recovered": None, "problems": problems[:5], "counters": self.backend.counters}

    def stop(self) -> dict:
        self.traffic.stop()
        out = {"records": self.traffic.records, "counters": self.backend.counters}
        if self.door_b is not None and self.door_b.poll() is None:
            os.killpg(self.door_b.pid, signal.SIGTERM)
            self.door_b.wait(timeout=30)
        self._server.__exit__(None, None, None)
        self.backend.shutdown(stop_cluster=True)
        return out


def _wait_healthy(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.25)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    head, node_ip, model_dir, seed, concurrency, tp_size = argv[0], argv[1], argv[2], *map(int, argv[3:6])
    driver = Driver(head, node_ip, model_dir, seed, concurrency, tp_size)
    _emit(ready=True, replicas=driver.where(), counters=driver.backend.counters)
    driver.traffic.start()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "fault":
            _emit(**driver.fault(cmd["name"]))
        elif cmd["cmd"] == "recover":
            _emit(**driver.recover(float(cmd.get("timeout_s", 120))))
        elif cmd["cmd"] == "where":
            _emit(replicas=driver.where())
        elif cmd["cmd"] == "stop":
            _emit(**driver.stop())
            return 0
    driver.stop()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
