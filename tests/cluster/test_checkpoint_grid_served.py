"""`engine.checkpoint_grid: attention` through `hybridserve serve`'s app (one engine in process,
real uvicorn, httpx): the startup cacheability names the 16-token grid and the spacing bound, a
resend's `cached_tokens` is 288 (256 on the Mamba grid), its text equals the cold run's, and the
cluster's description of the replica gives the same profile.

Wrong changes this catches: the config key not reaching the engine (the hit stays 256), the
cluster's profile built without the spacing bound, and a hit whose output differs."""

import logging

import httpx

from cluster.cache_profile import replica_cache_profile
from cluster.config_loader import load_config
from cluster.http.local_server import serve_app
from tests.conftest import make_prompt

SETTINGS = {"cluster.backend": "inprocess", "engine.kernels": "torch", "engine.max_model_len": 1024,
            "engine.cache_memory_bytes": 64 * 2**20, "engine.checkpoint_grid": "attention"}


def test_a_resend_hits_on_the_kv_block_through_the_server(tiny_dir):
    from cluster.serve import build_app

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("hybridserve.serve")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        server = build_app(load_config(None, settings={**SETTINGS, "model.path": tiny_dir}))
    finally:
        logger.removeHandler(handler)
    log = "\n".join(r.getMessage() for r in records)
    body = {"prompt": make_prompt(300, 21), "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    try:
        with serve_app(server.app) as url, httpx.Client(base_url=url, timeout=120) as c:
            cold, warm = (c.post("/v1/completions", json=body).json() for _ in range(2))
        engine = server.backend.engine
        described = replica_cache_profile(tuple(engine.cache.layout.describe()),
                                          engine.cache.coordinator.eagle.value, engine.config)
        assert described == server.app.state.cache_reports.profile
    finally:
        server.close()
    assert "hit grid 16 tokens (lcm of full:16, mamba:16, draft:16)" in log
    assert "and at least every 64 tokens" in log
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
