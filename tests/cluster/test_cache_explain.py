"""Cacheability at a glance, end to end on `hybridserve serve`'s app (`cluster.serve.build_app`, one
engine in process, real uvicorn, httpx): the startup block, the miss counter by reason and
`GET /v1/cache/explain/{id}` with an API key set."""

import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config_loader import load_config
from cluster.http.local_server import serve_app
from tests.conftest import make_prompt

KEY = {"Authorization": "Bearer k"}
# budget of retained Mamba states: 2 pages of the tiny model's 292,864 bytes (64 MiB x 0.0105)
SETTINGS = {"cluster.backend": "inprocess", "engine.kernels": "torch", "engine.max_model_len": 1024,
            "engine.cache_memory_bytes": 64 * 2**20, "engine.eagle_mode": "drop", "engine.eviction": "lru",
            "engine.checkpoint_memory_fraction": 0.0105, "http.api_key": "k", "http.max_explained_requests": 4}


def misses(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "hybridserve_prefix_cache_misses_total"}


@pytest.fixture(scope="module")
def served(tiny_dir):
    """The server's startup log, then, in order, (name, response, misses after it) for: three
    300-token prompts (the third's snapshot evicts the first's state: a budget of 2), the third
    resent (a hit), the first resent, streamed (its state was evicted), a 40-token prompt and
    its resend (below the 64-token grid), the second under another tenant's cache_salt."""
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
    prompts = {"a": make_prompt(300, 1), "b": make_prompt(300, 2), "c": make_prompt(300, 3), "s": make_prompt(40, 4)}
    steps = []
    try:
        with serve_app(server.app) as url, httpx.Client(base_url=url, headers=KEY, timeout=120) as c:
            for name in ("a", "b", "c", "c", "a", "s", "s", "b"):
                body = {"prompt": prompts[name], "max_tokens": 4, "ignore_eos": True, "temperature": 0}
                if len(steps) == 7:
                    body["cache_salt"] = "tenant-2"
                if len(steps) == 4:  # the evicted resend goes through the SSE path
                    with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}}) as r:
                        assert r.status_code == 200
                        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
                    response = httpx.Response(200, text=chunks[-1]).json()
                else:
                    response = c.post("/v1/completions", json=body).json()
                steps.append((name, response, misses(c)))
            yield url, "\n".join(r.getMessage() for r in records), steps, server
    finally:
        server.close()


def test_startup_logs_the_models_cacheability(served):
    _, log, _, server = served
    model = server.app.state.cache_reports.profile
    assert model.alignment == 64 and model.shortest_hit_prompt == 80
    assert "hit grid 64 tokens (lcm of full:16, mamba:64, draft:16); shortest prompt that can hit: 80 tokens " \
           "(an identical resend; EAGLE drop (lookahead rule); retention latest)" in log
    assert "  draft:16: every 16-token draft KV block of the prefix; EAGLE drop: the 16-token block starting " \
           "at the hit too" in log


def test_a_cluster_replicas_description_gives_the_same_profile(served):
    from cluster.cache_profile import replica_cache_profile

    _, _, _, server = served
    engine = server.backend.engine  # what `Replica.describe` reports of its engine
    described = replica_cache_profile(tuple(engine.cache.layout.describe()), engine.cache.coordinator.eagle.value,
                                      engine.config)
    assert described == server.backend.cache_profile == server.app.state.cache_reports.profile


def test_the_miss_counter_counts_each_short_hit_under_its_reason_and_no_hit(served):
    _, _, steps, _ = served
    zero = dict.fromkeys(("kv_evicted", "below_grid", "eagle_drop", "state_evicted", "state_not_retained", "salt"),
                         0.0)
    counts = [s[2] for s in steps]
    assert counts[:4] == [zero] * 4  # three cold prompts sharing nothing, then a full hit
    assert steps[3][1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert counts[4] == {**zero, "state_evicted": 1.0}
    assert steps[4][1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert counts[5] == counts[4]  # a 40-token prompt nobody sent before
    assert counts[6] == {**zero, "state_evicted": 1.0, "below_grid": 1.0}
    assert counts[7] == {**zero, "state_evicted": 1.0, "below_grid": 1.0, "salt": 1.0}


def test_explain_a_served_request_by_its_response_id_or_its_request_id(served):
    url, _, steps, _ = served
    with httpx.Client(base_url=url, headers=KEY, timeout=30) as c:
        evicted = c.get(f"/v1/cache/explain/{steps[4][1]['id']}")
        assert evicted.status_code == 200
        body = evicted.json()
        assert body["id"] == steps[4][1]["id"] and body["request_id"].startswith("req-")
        assert (body["reason"], body["reason_position"], body["hit_tokens"]) == ("state_evicted", 256, 0)
        assert (body["num_prompt_tokens"], body["shared_prefix_tokens"], body["attention_match_tokens"]) == (
            300, 288, 256)
        assert body["groups"] == ["full:16", "mamba:64", "draft:16"] and body["shortest_hit_prompt"] == 80
        assert body["explanation"][-1] == "reason: state_evicted: the Mamba state at 256 was retained, then " \
                                          "evicted under memory pressure"
        assert c.get(f"/v1/cache/explain/{body['request_id']}").json() == body
        hit = c.get(f"/v1/cache/explain/{steps[6][1]['id']}").json()
        assert (hit["reason"], hit["shared_prefix_tokens"], hit["hit_tokens"]) == ("below_grid", 32, 0)
        salted = c.get(f"/v1/cache/explain/{steps[7][1]['id']}").json()
        assert (salted["reason"], salted["reason_position"], salted["hit_tokens"]) == ("salt", 64, 0)


def test_explain_keeps_only_the_last_n_requests(served):
    url, _, steps, _ = served
    with httpx.Client(base_url=url, headers=KEY, timeout=30) as c:
        kept = [c.get(f"/v1/cache/explain/{s[1]['id']}").status_code for s in steps]
    assert kept == [404, 404, 404, 404, 200, 200, 200, 200]  # http.max_explained_requests: 4


def test_explain_of_an_unknown_id_is_an_openai_404(served):
    url, _, _, _ = served
    r = httpx.get(f"{url}/v1/cache/explain/cmpl-nosuchrequest", headers=KEY)
    assert r.status_code == 404
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("not_found_error", "request_id", 404)
    assert "cmpl-nosuchrequest" in error["message"]


def test_explain_needs_the_api_key(served):
    url, _, steps, _ = served
    path = f"{url}/v1/cache/explain/{steps[4][1]['id']}"
    assert httpx.get(path, headers=KEY).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(path, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"


def test_the_report_crosses_the_replica_boundary_on_every_merged_output():
    """A replica merges a stream's outputs (`merge_outputs`) and Ray pickles them: the front end
    still sees the lookup, equal to the engine's (it records each distinct report once)."""
    import pickle

    from cache_service.miss_reasons import LookupReport
    from workers.engine.request import RequestOutput
    from workers.replica_messages import merge_outputs

    report = LookupReport(300, 0, (256, 0, 256), 256, 288, (256, 0), "state_evicted", 256)
    outputs = [RequestOutput("req-1", (t,), (), False, None, 300, 0, None, 0, 0, cache_report=report) for t in (5, 6)]
    merged = pickle.loads(pickle.dumps(merge_outputs(outputs)))
    assert merged.new_token_ids == (5, 6) and merged.cache_report == report
