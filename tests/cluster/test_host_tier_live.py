"""The host tier live (issue 29): `hybridserve serve`'s app (`cluster.serve.build_app`) on a
2-replica Ray cluster (cache service, front door, replica actors) with a small device cache and a
host tier, over real HTTP (`/v1/completions`, token-id prompts, temperature 0), in every EAGLE
mode (k 0, k 3 drop, k 3 lossless; one Ray session for the module, one cluster per mode).

Traffic: a 300-token prompt P cold, then NUM_FLOOD other prompts that share P's first 64 tokens
and push the rest of P off the device, then P again. The floods share a 64-token attention match
with P, so prefix affinity routes them to P's replica A once it is idle; the router then expects
P's full hit there from its host tier. Each request's replica is read from /metrics around it.
The resend's response equals the cold one, its hit (256) is reported in `usage`, /metrics
`hybridserve_prefix_cache_host_hit_tokens_total` grows by it, the explain endpoint names the host
tier, and A's engine gauges (`hybridserve_engine_num_host_*{replica}`) show the pages demoted by
the floods and promoted by the resend.

A transfer from the host tier: P's promotion pushed the first flood F off A's device in turn; F
forced onto the other replica B (`ClusterBackend.generate(replica_id=B)`, the front door's one way
to name a replica; HTTP has none) makes the front door move F's pages from A, which promotes them
from its host tier to send them; B then serves F's 256 tokens as a local hit, byte-identical.

The control: the same traffic on the same engine config without a host tier, in process (one
engine given exactly the traffic A got: ~1 s, where a Ray cluster costs ~6 s to build) hits
nothing on the resend (the device alone lost P).
"""

import contextlib
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.config_loader import load_config
from cluster.http.local_server import serve_app
from tests.conftest import make_prompt

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(240)]

# (k, eagle): the hit of a 300-token resend is floor(299 / 64) * 64 = 256 in each (drop mode too:
# the draft block [256, 272) is inside the prompt)
MODES = [(0, None), (3, "drop"), (3, "lossless")]
HIT = 256
SHARED = 64  # tokens the floods share with P: one alignment unit, the router's smallest attention match
# 5 MiB, 3/4 for Mamba pages: P alone stays on the device, two 300-token prompts push it off (one
# is enough with drafts); the host tier holds all of them
NUM_FLOOD = 2
ENGINE = {"engine.kernels": "torch", "engine.max_model_len": 320, "engine.cache_memory_bytes": 5 * 2**20,
          "engine.mamba_memory_fraction": 0.75}
HOST_CACHE_BYTES = 24 * 2**20
MAX_TOKENS = 4
PROMPT = make_prompt(300, 7)
FLOODS = [PROMPT[:SHARED] + make_prompt(300, 100 + i)[SHARED:] for i in range(NUM_FLOOD)]
HOST_GAUGES = ("num_host_pages", "num_host_demoted_pages", "num_host_promoted_pages")


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
    """The samples this test reads: host hit tokens, routing decisions as 'replica=R' and
    'reason=X', transfers done and their bytes, and each replica's host-tier gauges as
    'num_host_pages@R' (R empty for an engine in process)."""
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == "hybridserve_prefix_cache_host_hit_tokens_total":
                out["host_hit_tokens"] = s.value
            elif s.name == "hybridserve_routing_decisions_total":
                out[f"replica={s.labels['replica']}"] = s.value
            elif s.name == "hybridserve_routing_decisions_by_reason_total":
                out[f"reason={s.labels['reason']}"] = s.value
            elif s.name == "hybridserve_transfers_total":
                out[f"transfers={s.labels['outcome']}"] = s.value
            elif s.name == "hybridserve_transfer_bytes_total":
                out["transfer_bytes"] = s.value
            elif s.name.removeprefix("hybridserve_engine_") in HOST_GAUGES:
                out[f"{s.name.removeprefix('hybridserve_engine_')}@{s.labels.get('replica', '')}"] = s.value
    return out


def growth(before: dict, after: dict) -> dict:
    """The samples that changed, by how much."""
    return {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}


def dry_route(server, prompt: list[int]):
    """(target, decision) of the front door's router for `prompt` now: a dry run, nothing booked."""
    from workers.engine.sampling_params import SamplingParams
    from workers.replica_messages import GenerateMsg

    backend = server.backend
    msg = GenerateMsg("dry-run", tuple(prompt), SamplingParams(max_tokens=MAX_TOKENS), None,
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
    """The router expects the prompt's full hit on P's replica (from its host tier)."""
    return dry_route(server, prompt)[1].hit_on(holder) == HIT


def run_traffic(url: str, server) -> tuple[list[tuple[dict, dict, dict]], dict]:
    """P cold, NUM_FLOOD floods, P again: per request (response, /metrics before, after); and the
    resend's explain body. On a Ray cluster each request waits until the router sends it to P's
    replica (the resend: expects P's host hit there)."""
    steps, holder = [], None
    with httpx.Client(base_url=url, timeout=120) as client:
        for i, p in enumerate([PROMPT, *FLOODS, PROMPT]):
            if holder is not None:  # a Ray cluster
                settled = routed_to_holder if i <= NUM_FLOOD else hit_expected_on_holder
                wait_until(settled, server, p, holder)
            before = scrape(client)
            r = client.post("/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "ignore_eos": True})
            assert r.status_code == 200, r.text
            after = scrape(client)
            steps.append((r.json(), before, after))
            routed = [key.removeprefix("replica=") for key in growth(before, after) if key.startswith("replica=")]
            holder = holder or (routed[0] if routed else None)
        explained = client.get(f"/v1/cache/explain/{steps[-1][0]['id']}").json()
    return steps, explained


def force_elsewhere(url: str, server, prompt: list[int], holder: str):
    """`prompt` forced onto the replica that is not `holder`, once the router expects its full hit
    on `holder`: (its output, the replica that served it, /metrics growth over it)."""
    from workers.engine.sampling_params import SamplingParams

    other = next(r for r in server.backend.replica_ids if r != holder)
    wait_until(hit_expected_on_holder, server, prompt, holder)
    with httpx.Client(base_url=url, timeout=120) as client:
        before = scrape(client)
        out, served_by = server.backend.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), replica_id=other)
        return out, served_by, growth(before, scrape(client))


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("k, eagle", MODES, ids=["k0", "k3-drop", "k3-lossless"])
def test_a_prefix_pushed_off_the_device_is_served_from_the_host_tier(ray_session, tiny_dir, k, eagle):
    """Catches: a host tier the replicas never got (config not reaching them: hit 0), a host hit
    not counted on /metrics or not reported across the replica boundary (usage, explain), a
    router blind to the host tier (it never expects the hit), floods that never pushed P off the
    device (the control hits), a promotion of wrong pages where the 4 greedy tokens show it (the
    byte-for-byte page checks are tests/engine/test_host_tier.py's), replica host gauges missing
    from a cluster's /metrics or filed under the wrong replica; and for the transfer: a sender
    that only looks at its device (nothing to send: B recomputes, hit 0), host pages sent without
    promotion (A's promoted gauge stays), wrong or stale pages sent (B's 4 tokens differ); a
    replica whose load reports do not carry its measured host-hit price."""
    with serving(tiny_dir, "ray", k, eagle, HOST_CACHE_BYTES) as (url, server):
        steps, explained = run_traffic(url, server)
        (cold, _, _), (flood, _, _) = steps[0], steps[1]
        holder = [key.removeprefix("replica=") for key in growth(*steps[0][1:]) if key.startswith("replica=")]
        assert len(holder) == 1, steps[0]
        moved, served_by, moved_growth = force_elsewhere(url, server, FLOODS[0], holder[0])
        loads = ray.get(server.backend.routing.service.stats.remote(), timeout=30)["loads"]
    (a,), b = holder, served_by
    for _, before, after in steps:  # every request on P's replica
        assert {key for key in growth(before, after) if key.startswith("replica=")} == {f"replica={a}"}
    *_, (warm, flooded, resent) = steps
    # A's host tier took the pages the floods pushed off its device; B's holds nothing
    assert flooded[f"num_host_pages@{a}"] > 0 and flooded[f"num_host_demoted_pages@{a}"] > 0
    assert flooded[f"num_host_pages@{b}"] == 0
    # a flood may hit the shared 64 tokens (the junction state a flood before it left there)
    assert cached(cold) == 0 and all(cached(r) <= SHARED for r, _, _ in steps[1:-1])
    assert "host_hit_tokens" not in growth(*steps[0][1:])
    assert warm["choices"] == cold["choices"]  # text, token ids, finish reason: byte-identical
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": HIT, "computed_tokens": 300 - HIT}
    warm_growth = growth(flooded, resent)
    assert warm_growth["host_hit_tokens"] == HIT and warm_growth[f"num_host_promoted_pages@{a}"] > 0
    assert explained["hit_tier"] == "host" and explained["hit_tokens"] == HIT
    assert sum(explained["host_promoted_pages"]) > 0
    # the flood forced onto B: its pages left A's host tier (promoted there to be sent), B hit them
    assert b != a and list(moved.token_ids) == flood["choices"][0]["token_ids"]
    assert moved.num_cached_tokens == HIT and moved.num_computed_prompt_tokens == 300 - HIT
    assert moved_growth["reason=forced"] == 1 and moved_growth["transfers=ok"] == 1
    assert moved_growth["transfer_bytes"] > 0 and moved_growth[f"num_host_promoted_pages@{a}"] > 0
    assert f"num_host_promoted_pages@{b}" not in moved_growth  # a device hit on B, not a promotion
    # A measured its own price of a host hit and reported it with its load: the router prices A's
    # host tokens by it (`HostCopyPrice`; the unit tests check the routing on it)
    price = loads[a]["host_copy"]
    assert price["fixed_tokens"] > 0 and price["tokens_per_token"] > 0 and price["bytes_per_s"] > 0
    # the control: the same traffic, the same device, no host tier
    with serving(tiny_dir, "inprocess", k, eagle, 0) as (url, server):
        plain, plain_explained = run_traffic(url, server)
    assert cached(plain[-1][0]) == 0 and plain[-1][0]["choices"] == cold["choices"]
    assert plain_explained["hit_tier"] is None
