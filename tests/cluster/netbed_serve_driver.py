"""A hybridserve cluster across the bed's hosts (`tests/cluster/test_netbed_serving.py`): the front
door runs here, inside host 0's namespace (`NetBed.popen_in`), and starts the cluster on the bed's
Ray. One JSON line per phase on stdout; between phases it waits for a line on stdin, so the test
reads the veth counters around the transfer alone:

    python -m tests.cluster.netbed_serve_driver HEAD NODE_IP MODEL_DIR

    -> {"replicas": ..., "holder": ..., ...}   2 replicas up; where each actor runs (host addresses,
                                               from the GCS); the prompt served cold on its holder
    <- a line                                  (the test has read the counters)
    -> {"served": ..., "tokens": ..., ...}     the same prompt forced onto the other replica: the
                                               holder's pages move first, then it is served there
    <- a line
    -> {"fast": {...}}                         a second prompt, the link now measured fast: moved
    <- a line                                  (the test has slowed the holder's link with tbf)
    -> {"slow": {...}, "skipped": {...}}       a third prompt moved once more (the fast measurement),
                                               which measures the link slow; a fourth recomputes
    <- a line
    -> {"stopped": true}                       the cluster shut down (replicas, service, controller)

Each move phase serves a new prompt cold on the holder, then forces it onto the other replica
and reports the front door's link choice (`cluster.frontdoor.page_mover`).

Not `tests.conftest`'s `make_prompt`: importing it keeps Ray on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER).
"""

from __future__ import annotations

import json
import random
import sys

from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

CONFIG = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=64 * 2**20)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT_LEN = 600
NAMESPACE = "hybridserve-netbed"


def make_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _actor_addresses(names: list[str]) -> dict[str, str | None]:
    """The host address each named live actor runs at, as the GCS has it."""
    from ray._private.state import actors

    alive = {a["Name"]: a["Address"]["IPAddress"] for a in actors().values() if a["State"] == "ALIVE"}
    return {name: alive.get(name) for name in names}


def _move_phase(backend, prompt: list[int], holder: str, other: str) -> dict:
    """`prompt` cold on `holder`, then forced onto `other`: the link choice and what it served."""
    cold, on = backend.generate(prompt, PARAMS, replica_id=holder)
    before = backend.counters
    forced, served = backend.generate(prompt, PARAMS, replica_id=other)
    after = backend.counters
    choice = backend.mover.last_choice
    return {"cold_on": on, "served": served, "same_tokens": forced.token_ids == cold.token_ids,
            "num_cached_tokens": forced.num_cached_tokens,
            "transfers": after["transfers"] - before["transfers"],
            "skipped": after["transfers_skipped_slow_link"] - before["transfers_skipped_slow_link"],
            "move": choice.move, "measured": choice.measured, "transfer_s": choice.transfer_s,
            "recompute_s": choice.recompute_s, "link_bytes_per_s": choice.link_bytes_per_s}


def serve(head: str, node_ip: str, model_dir: str) -> dict:
    import ray

    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend
    from cluster.http.metrics import Metrics
    from cluster.ids import controller_name

    ray.init(address=head, _node_ip_address=node_ip, namespace=NAMESPACE, log_to_driver=False,
             configure_logging=False)
    backend = ClusterBackend(model_dir, CONFIG, ClusterConfig(name=None, num_replicas=2))
    metrics = backend.metrics = Metrics()
    try:
        node_address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        prompt = make_prompt(PROMPT_LEN, 1)
        cold, holder = backend.generate(prompt, PARAMS)
        other = next(r for r in backend.replica_ids if r != holder)
        where = _actor_addresses([controller_name(backend.name), backend.service_name])
        _emit(replicas={r: node_address[backend.replicas.get(r).info.node_id] for r in backend.replica_ids},
              holder=holder, other=other, frontdoor=ray.util.get_node_ip_address(),
              controller=where[controller_name(backend.name)], service=where[backend.service_name],
              tokens=list(cold.token_ids), num_cached_tokens=cold.num_cached_tokens)
        sys.stdin.readline()
        forced, served = backend.generate(prompt, PARAMS, replica_id=other)
        _emit(served=served, tokens=list(forced.token_ids), num_cached_tokens=forced.num_cached_tokens,
              num_computed_prompt_tokens=forced.num_computed_prompt_tokens,
              transfers=backend.counters["transfers"],
              transfer_bytes=metrics.registry.get_sample_value("hybridserve_transfer_bytes_total"))
        sys.stdin.readline()
        _emit(fast=_move_phase(backend, make_prompt(PROMPT_LEN, 2), holder, other))
        sys.stdin.readline()
        _emit(slow=_move_phase(backend, make_prompt(PROMPT_LEN, 3), holder, other),
              skipped=_move_phase(backend, make_prompt(PROMPT_LEN, 4), holder, other),
              links=backend.mover.links.snapshot(),
              skipped_metric=metrics.registry.get_sample_value("hybridserve_transfers_total",
                                                               {"outcome": "skipped_slow_link"}))
        sys.stdin.readline()
    finally:
        backend.shutdown()
        ray.shutdown()
    return {"stopped": True}


if __name__ == "__main__":
    _emit(**serve(*sys.argv[1:4]))
