"""The host tier live (issue 29): `hybridserve serve`'s app (`cluster.serve.build_app`) on a small
device cache with a host tier, over real HTTP (`/v1/completions`, token-id prompts, temperature 0).

Traffic: a 300-token prompt P cold, then NUM_FLOOD other prompts that share P's first 64 tokens
and push the rest of P off the device, then P again. The resend's response equals the cold one,
its hit (256) is reported in `usage`, /metrics `hybridserve_prefix_cache_host_hit_tokens_total`
grows by it, and the explain endpoint names the host tier. The control: the same traffic on the
same engine config without a host tier hits nothing on the resend (the device alone lost P).

Backends, by EAGLE mode (a Ray cluster costs 11-17 s to start on 2 cores, in process ~1 s):
    k 3 lossless   a 2-replica Ray cluster (cache service, front door, replica actors): the
                   floods share a 64-token attention match with P, so prefix affinity routes them
                   to P's replica once it is idle; the router then expects P's full hit there
                   from its host tier; each request's replica is read from /metrics around it
    k 0, k 3 drop  one engine in process (`cluster.backend: inprocess`), where /metrics also
                   shows the engine's promoted pages
Every control runs in process: one engine given exactly the traffic P's replica got.
"""

import contextlib
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import load_config
from cluster.http.local_server import serve_app
from tests.conftest import make_prompt

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(240)]

# (k, eagle, backend): the hit of a 300-token resend is floor(299 / 64) * 64 = 256 in each (drop
# mode too: the draft block [256, 272) is inside the prompt)
MODES = [(0, None, "inprocess"), (3, "drop", "inprocess"), (3, "lossless", "ray")]
HIT = 256
SHARED = 64  # tokens the floods share with P: one alignment unit, the router's smallest attention match
# 5 MiB, 3/4 for Mamba pages: P alone stays on the device, two 300-token prompts push it off (one
# is enough with drafts); the host tier holds all of them
NUM_FLOOD = 2
ENGINE = {"engine.kernels": "torch", "engine.max_model_len": 320, "engine.cache_memory_bytes": 5 * 2**20,
          "engine.mamba_memory_fraction": 0.75}
HOST_CACHE_BYTES = 24 * 2**20


@contextlib.contextmanager
def serving(tiny_dir, backend: str, k: int, eagle: str | None, host_cache_bytes: int):
    """(base URL, the `Server`) of `hybridserve serve`'s app on this engine config."""
    from cluster.serve import build_app

    settings = {**ENGINE, "model.path": tiny_dir, "cluster.backend": backend, "engine.num_spec_tokens": k,
                "engine.host_cache_bytes": host_cache_bytes}
    if eagle is not None:
        settings["engine.eagle_mode"] = eagle
    if backend == "ray":  # joins the module's Ray session (`ray_session`); a fresh cluster name
        settings.update({"cluster.num_replicas": 2, "cluster.name": None})
    server = build_app(load_config(None, settings=settings))
    try:
        with serve_app(server.app) as url:
            yield url, server
    finally:
        server.close()


def scrape(client: httpx.Client) -> dict[str, float]:
    """The samples this test reads: host hit tokens, routing decisions as 'replica=R', and (an
    engine in process) its promoted pages."""
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == "hybridserve_prefix_cache_host_hit_tokens_total":
                out["host_hit_tokens"] = s.value
            elif s.name == "hybridserve_engine_num_host_promoted_pages":
                out["promoted_pages"] = s.value
            elif s.name == "hybridserve_routing_decisions_total":
                out[f"replica={s.labels['replica']}"] = s.value
    return out


def dry_route(server, prompt: list[int]):
    """(target, decision) of the front door's router for `prompt` now: a dry run, nothing booked."""
    from workers.engine.sampling_params import SamplingParams
    from workers.replica_messages import GenerateMsg

    backend = server.backend
    msg = GenerateMsg("dry-run", tuple(prompt), SamplingParams(max_tokens=4), None,
                      backend.routing.hashes(tuple(prompt), None))
    return backend.routing.route(msg, {r: 0 for r in backend.replica_ids}, dry_run=True)


def wait_until(check, *args, timeout_s: float = 10.0) -> None:
    """The index and the loads follow the replicas' event pushes: poll until `check(*args)`."""
    deadline = time.monotonic() + timeout_s
    while not check(*args):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {check.__doc__}"
        time.sleep(0.05)


def routed_to_holder(server, prompt, holder) -> bool:
    """A flood goes to P's replica (by affinity, once that replica's last request left its load)."""
    return dry_route(server, prompt)[0] == holder


def hit_expected_on_holder(server, prompt, holder) -> bool:
    """The router expects P's full hit on P's replica (from its host tier)."""
    return dry_route(server, prompt)[1].hit_on(holder) == HIT


def run_traffic(url: str, server) -> list[tuple[dict, dict]]:
    """P cold, NUM_FLOOD floods, P again: per request (response, /metrics growth over it), then
    (the resend's explain body, {})."""
    prompt = make_prompt(300, 7)
    floods = [prompt[:SHARED] + make_prompt(300, 100 + i)[SHARED:] for i in range(NUM_FLOOD)]
    steps, holder = [], None
    with httpx.Client(base_url=url, timeout=120) as client:
        for i, p in enumerate([prompt, *floods, prompt]):
            if holder is not None:  # a Ray cluster
                settled = routed_to_holder if i <= NUM_FLOOD else hit_expected_on_holder
                wait_until(settled, server, p, holder)
            before = scrape(client)
            r = client.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0,
                                                     "ignore_eos": True})
            assert r.status_code == 200, r.text
            after = scrape(client)
            grown = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
            steps.append((r.json(), grown))
            routed = [key.removeprefix("replica=") for key in grown if key.startswith("replica=")]
            holder = holder or (routed[0] if routed else None)
        explained = client.get(f"/v1/cache/explain/{steps[-1][0]['id']}").json()
    return steps + [(explained, {})]


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("k, eagle, backend", MODES, ids=["k0-inprocess", "k3-drop-inprocess", "k3-lossless-ray"])
def test_a_prefix_pushed_off_the_device_is_served_from_the_host_tier(request, tiny_dir, k, eagle, backend):
    """Catches: a host tier the replicas never got (config not reaching them: hit 0), a host hit
    not counted on /metrics or not reported across the replica boundary (usage, explain), a
    router blind to the host tier (it never expects the hit), floods that never pushed P off the
    device (the control hits), a promotion of wrong pages where the 4 greedy tokens show it (the
    byte-for-byte page checks are tests/engine/test_host_tier.py's)."""
    if backend == "ray":
        request.getfixturevalue("ray_session")  # Ray on loopback for this module (2 CPUs)
    with serving(tiny_dir, backend, k, eagle, HOST_CACHE_BYTES) as (url, server):
        *steps, (explained, _) = run_traffic(url, server)
    (cold, cold_growth), *flooded, (warm, warm_growth) = steps
    if backend == "ray":  # every request on P's replica
        holder = [key for key in cold_growth if key.startswith("replica=")]
        assert len(holder) == 1, cold_growth
        for _, growth in steps:
            assert {key for key in growth if key.startswith("replica=")} == set(holder), growth
    else:  # the engine's own count: the resend promoted pages
        assert warm_growth["promoted_pages"] > 0
    # a flood may hit the shared 64 tokens (the junction state a flood before it left there)
    assert cached(cold) == 0 and all(cached(r) <= SHARED for r, _ in flooded) and "host_hit_tokens" not in cold_growth
    assert warm["choices"] == cold["choices"]  # text, token ids, finish reason: byte-identical
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": HIT, "computed_tokens": 300 - HIT}
    assert warm_growth["host_hit_tokens"] == HIT
    assert explained["hit_tier"] == "host" and explained["hit_tokens"] == HIT
    assert sum(explained["host_promoted_pages"]) > 0
    # the control: the same traffic, the same device, no host tier
    with serving(tiny_dir, "inprocess", k, eagle, 0) as (url, server):
        *plain, (plain_explained, _) = run_traffic(url, server)
    assert cached(plain[-1][0]) == 0 and plain[-1][0]["choices"] == cold["choices"]
    assert plain_explained["hit_tier"] is None
