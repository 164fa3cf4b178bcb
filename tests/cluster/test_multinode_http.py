"""End to end over HTTP on a simulated 2-node Ray cluster (`ray.cluster_utils.Cluster`), one
replica per node, built by `cluster.serve.build_app` exactly as `hybridserve serve` does:
a resent long prompt is routed to the replica holding its state and hits; the same prompt forced
to the other node's replica hits via a transfer; every warm output equals the cold output byte
for byte. Then: killing the cache service under traffic loses nothing, and the autoscaler adds
a replica warmed by transfers and removes it when idle."""

import json
import os
import tempfile
import threading
import time

import httpx
import pytest

from bench.fault_doubles import kill_cache_service
from cluster.config_loader import load_config
from tests.cluster.test_frontend_http import serve_app
from tests.conftest import make_prompt
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rm-", dir="/tmp")  # short: unix socket paths
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every address on loopback
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    deadline = time.monotonic() + 60
    while sum(n["Alive"] for n in ray.nodes()) < 2 or ray.cluster_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.2)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def served(two_nodes, tiny_dir, tmp_path_factory):
    from cluster import serve

    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(f"""
cluster: {{ray_address: "{two_nodes.address}", num_replicas: 2, min_replicas: 2, max_replicas: 3,
          scale_up_queue_depth: 2.0, scale_down_idle_s: 0.5, autoscale_interval_s: 3600}}
model: {{path: {tiny_dir}}}
engine: {{kernels: torch, max_model_len: 2048, cache_memory_bytes: 67108864, num_spec_tokens: 3,
         eagle_mode: lossless}}
""")
    server = serve.build_app(load_config(path))
    with serve_app(server.app) as url:
        yield url, server
    server.close()


def _stream(url: str, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], dict, float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    ids, usage, t0, ttft = [], None, time.perf_counter(), None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["token_ids"] and ttft is None:
                ttft = time.perf_counter() - t0
            ids += chunk["choices"][0]["token_ids"] if chunk["choices"] else []
            usage = chunk.get("usage") or usage
    return ids, usage, ttft


def test_replicas_live_on_different_nodes(served):
    _, server = served
    import ray

    nodes = {r["node_id"] for r in server.backend.stats()["replicas"].values()}
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2, (nodes, alive, server.backend.replicas.spread(2))


def test_resend_routes_to_holder_and_forced_replica_hits_via_transfer(served):
    url, server = served
    backend = server.backend
    prompt = make_prompt(600, 41)
    cold, usage, _ = _stream(url, prompt)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "computed_tokens": 600}
    before = dict(backend.counters)
    warm, usage, _ = _stream(url, prompt)
    # floor(599 / 64) * 64 = 576 (lossless: no drop); the replica's model ran the other 24
    assert warm == cold and usage["prompt_tokens_details"] == {"cached_tokens": 576, "computed_tokens": 24}
    assert backend.counters["transfers"] == before["transfers"]  # served where the state lives: no transfer
    # which replica holds it, and force the other one (pages move first, then a normal local hit)
    holder = max(backend.replica_ids, key=lambda r: backend.service_stats()["replicas"][r]["entries"][1])
    other = next(r for r in backend.replica_ids if r != holder)
    forced, served_by = backend.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                         replica_id=other)
    assert served_by == other and backend.counters["transfers"] == before["transfers"] + 1
    assert list(forced.token_ids) == cold and forced.num_cached_tokens == 576
    assert forced.num_computed_prompt_tokens == 600 - 576  # the moved pages were used, not recomputed
    metrics = httpx.get(f"{url}/metrics").text
    assert 'hybridserve_transfers_total{outcome="ok"}' in metrics


def test_killing_the_cache_service_under_http_traffic_loses_nothing(served):
    url, server = served
    prompts = [make_prompt(260 + 30 * i, 60 + i) for i in range(6)]
    cold = [_stream(url, p)[0] for p in prompts]
    results: list = [None] * len(prompts)

    def send(i):
        results[i] = _stream(url, prompts[i])[0]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    kill_cache_service(server.backend)
    for t in threads:
        t.join(timeout=120)
    assert results == cold  # every request completed, byte-identical


class ReplicaCountSampler:
    """The controller's replica count (its membership, draining replicas included), sampled on a
    thread for as long as the `with` block runs."""

    def __init__(self, controller) -> None:
        self.controller = controller
        self.counts: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-count-sampler")

    def _run(self) -> None:
        import ray

        while not self._stop.wait(0.05):
            try:
                self.counts.append(len(ray.get(self.controller.membership.remote(), timeout=60).replicas))
            except Exception as exc:  # noqa: BLE001 - kept and asserted on: a dead sampler must not pass silently
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> "ReplicaCountSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_autoscaler_adds_a_warmed_replica_and_removes_it_when_idle(served):
    """min 2, max 3, idle 0.5 s: the count stays within [2, 3] at every sample while the autoscaler
    adds a warmed replica under load and removes one once idle. (The rules themselves, the idle
    period included, are unit-tested on an injected clock: tests/cluster/test_autoscaler_bounds.py.)"""
    from cluster.control.autoscaler import ScaleAction, ScaleReason

    url, server = served
    backend, scaler = server.backend, server.autoscaler
    hot = make_prompt(700, 77)
    with ReplicaCountSampler(backend.controller) as sampler:
        cold = _stream(url, hot)[0]
        # make it the hottest prefix of the module (earlier tests sent theirs at most 3 times): warming
        # copies the hottest `warm_prefixes`, and a prompt seen once ties with the 6 streams below
        for _ in range(3):
            assert _stream(url, hot)[0] == cold
        streams = [backend.submit(make_prompt(400, 80 + i), SamplingParams(temperature=0.0, max_tokens=32,
                                                                           ignore_eos=True))
                   for i in range(6)]
        event = scaler.step()  # 6 in flight on 2 replicas > 2.0 per replica
        assert event.action is ScaleAction.UP and event.reason is ScaleReason.QUEUE_DEPTH and event.warmed >= 1
        for s in streams:
            list(s)
        new = event.replica_id
        warm, served_by = backend.generate(hot, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                           replica_id=new)
        assert served_by == new and warm.num_cached_tokens == 640 and list(warm.token_ids) == cold, backend.counters
        deadline = time.monotonic() + 60  # the first idle step starts the 0.5 s idle period; wait it out
        while (down := scaler.step()).action is ScaleAction.NONE:
            assert down.reason is ScaleReason.STEADY and time.monotonic() < deadline
            time.sleep(0.1)
        assert down.action is ScaleAction.DOWN and down.reason is ScaleReason.IDLE and len(backend.replica_ids) == 2
        # samples in flight when the removal returned may predate it: wait for two taken after it
        after, deadline = len(sampler.counts), time.monotonic() + 60
        while len(sampler.counts) < after + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    counts = sampler.counts
    assert not sampler.errors, sampler.errors
    assert counts and min(counts) >= 2 and max(counts) <= 3, counts
    assert 3 in counts and counts[-1] == 2, counts  # the samples saw the new replica come and go
