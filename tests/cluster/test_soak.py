"""Backpressure and a bounded soak: many requests through the HTTP app keep memory flat, and a
full ClusterBackend answers 429 with Retry-After instead of queueing without bound."""

import os
import tempfile
import time

import pytest
from fastapi.testclient import TestClient

from cluster.http.app import create_app
from tests.conftest import make_engine, make_prompt
from workers.engine.config import EngineConfig
from workers.engine.errors import ServerOverloadedError
from workers.engine.sampling_params import SamplingParams
from workers.engine_runner import EngineRunner

MB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.heavy
@pytest.mark.timeout(120)
def test_soak_many_requests_keep_memory_flat(tiny_model):
    runner = EngineRunner(make_engine(tiny_model, cache_memory_bytes=32 * MB), max_queued=8)
    client = TestClient(create_app(runner, "tiny"))

    def send(i: int, stream: bool) -> None:
        body = {"prompt": make_prompt(40 + i % 50, i), "max_tokens": 4, "ignore_eos": True, "stream": stream,
                "cache_salt": f"t{i % 7}"}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text

    try:
        for i in range(60):  # warm up: pools, caches, metrics label sets
            send(i, i % 2 == 0)
        start = _rss_bytes()
        for i in range(60, 160):  # a fixed count (it was "as many as 12 s allow": a wall-clock bound
            send(i, i % 2 == 0)  # that a slow machine missed with 85)
        growth = _rss_bytes() - start
        assert growth < 50 * MB, f"RSS grew {growth / MB:.1f} MB over 100 requests"
        assert runner.num_unfinished == 0
    finally:
        runner.shutdown()


@pytest.mark.heavy
@pytest.mark.timeout(120)
def test_full_cluster_backend_answers_429_with_retry_after(tiny_dir):
    import ray

    from cluster.config import ClusterConfig
    from cluster.control.ray_cluster import start_local_ray
    from cluster.frontdoor.backend import ClusterBackend

    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    start_local_ray(num_cpus=1)
    config = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=32 * MB)
    backend = ClusterBackend(tiny_dir, config, ClusterConfig(name=None, num_replicas=1, max_inflight=2))
    try:
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        streams = [backend.submit(make_prompt(64, s), long) for s in (1, 2)]
        with pytest.raises(ServerOverloadedError) as exc:
            backend.submit(make_prompt(64, 3), long)
        assert exc.value.retry_after_s > 0
        client = TestClient(create_app(backend, "tiny"))
        r = client.post("/v1/completions", json={"prompt": make_prompt(64, 4), "max_tokens": 4})
        assert r.status_code == 429 and float(r.headers["Retry-After"]) > 0
        assert r.json()["error"]["type"] == "rate_limit_error"
        for s in streams:
            backend.abort(s.request_id)
            list(s)
        deadline = time.monotonic() + 30
        while backend.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(backend.replica_ids) == 1 and backend.counters["replica_deaths"] == 0  # an abort is no death
        r = client.post("/v1/completions", json={"prompt": make_prompt(64, 4), "max_tokens": 4})
        assert r.status_code == 200  # room again once the in-flight requests are gone
    finally:
        backend.shutdown()
        ray.shutdown()
