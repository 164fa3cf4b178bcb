"""Tenant isolation and transfer-channel membership.

Different `cache_salt`s hash to disjoint keys: tenant B never hits tenant A's prefix (hit
counters), and the router's decision and estimates for B's prompt are the same whether or not A
sent that prefix before, so routing leaks no timing signal. A transfer channel opened with the
wrong cluster secret never meets a member: it waits alone and times out."""

import os
import tempfile
import threading
import time

import pytest
import torch

from cache_service.block_hash import RequestBlockHashes
from cache_service.service import CacheService
from tests.conftest import make_prompt
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.transfer_channel import PairChannel, StoreHost, channel_namespace

GROUPS = ["full:16", "mamba:64", "draft:16"]


def _service(queued: dict[str, int]) -> CacheService:
    from cache_service.messages import LoadReportMsg

    service = CacheService(GROUPS, "lossless", "fp", seed=0)
    for r, tokens in queued.items():
        service.add_replica(r)
        service.loads.report(r, LoadReportMsg(num_queued_tokens=tokens))
    return service


def _route(service: CacheService, prompt: list[int], salt: str):
    from cache_service.messages import RouteRequestMsg

    h = RequestBlockHashes(service.layout.hash_block_size, prompt, model_fingerprint="fp", cache_salt=salt)
    return service.route(RouteRequestMsg(tuple(h.hashes), len(prompt), salt, dry_run=True))


def _hold(service: CacheService, replica: str, prompt: list[int], salt: str) -> None:
    """`replica` caches every page of `prompt` under `salt` (as its events would report)."""
    h = RequestBlockHashes(service.layout.hash_block_size, prompt, model_fingerprint="fp", cache_salt=salt)
    n = len(prompt) // 64 * 64
    full = [h.prefix_hash(e) for e in range(16, n + 1, 16)]
    service.resync(replica, [full, [h.prefix_hash(e) for e in range(64, n + 1, 64)], full], 0)


def test_another_tenants_prefix_gives_no_hit_and_leaves_the_decision_unchanged():
    prompt, queued = make_prompt(700, 5), {"r0": 300, "r1": 0}
    before = _route(_service(queued), prompt, "tenant-b")
    service = _service(queued)
    _hold(service, "r0", prompt, "tenant-a")
    after = _route(service, prompt, "tenant-b")
    assert all(e.hit_tokens == 0 and e.attention_tokens == 0 for e in after.estimates)
    assert after == before and after.transfer is None
    own = _route(service, prompt, "tenant-a")  # the control: A itself hits (r0 busy: a transfer)
    assert own.expected_hit_tokens == 640 and own.transfer is not None and own.transfer.src_replica == "r0"


def test_salted_pages_are_disjoint_from_unsalted_and_other_tenants():
    prompt = make_prompt(300, 6)

    def keys(salt):
        h = RequestBlockHashes(16, prompt, model_fingerprint="fp", cache_salt=salt)
        return {h.prefix_hash(e) for e in range(16, 257, 16)}

    assert not keys("tenant-a") & keys("tenant-b") and not keys("tenant-a") & keys(None)


def wait_until_indexed(backend, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while backend.index_problems():
        assert time.monotonic() < deadline, backend.index_problems()
        time.sleep(0.1)


@pytest.fixture(scope="module")
def backend(tiny_dir):
    import ray

    from cluster.config import ClusterConfig
    from cluster.control.ray_cluster import start_local_ray
    from cluster.frontdoor.backend import ClusterBackend

    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ri", dir="/tmp")
    start_local_ray(num_cpus=2)
    config = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=64 * 2**20)
    b = ClusterBackend(tiny_dir, config, ClusterConfig(name=None, num_replicas=2, health_interval_s=0))
    yield b
    b.shutdown()
    ray.shutdown()


@pytest.mark.heavy
@pytest.mark.timeout(180)
def test_through_the_cluster_tenants_never_hit_each_other_and_routing_ignores_them(backend):
    import ray

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = make_prompt(600, 9)

    def decision_for_b():
        from cache_service.messages import RouteRequestMsg

        wait_until_indexed(backend)  # every pushed event is in the index
        msg = RouteRequestMsg(backend.routing.hashes(prompt, "tenant-b"), len(prompt), "tenant-b", dry_run=True)
        return ray.get(backend.service.route.remote(msg))

    before = decision_for_b()
    a_cold, a_replica = backend.generate(prompt, params, cache_salt="tenant-a")
    a_warm, again = backend.generate(prompt, params, cache_salt="tenant-a")
    assert a_warm.num_cached_tokens == 576 and again == a_replica  # the control: A's own resend hits
    after = decision_for_b()
    assert all(e.hit_tokens == 0 and e.attention_tokens == 0 for e in before.estimates + after.estimates)
    assert backend.service_stats()["num_entries"] > 0  # A's blocks are indexed: B sees none of them
    for replica in backend.replica_ids:  # wherever another tenant lands (A's holder too): a cold prefill
        b_out, served = backend.generate(prompt, params, cache_salt=f"tenant-b-{replica}", replica_id=replica)
        assert served == replica and b_out.num_cached_tokens == 0 and b_out.token_ids == a_cold.token_ids
    assert backend.counters["transfers"] == 0  # nothing of A's was moved for B


@pytest.mark.timeout(60)
def test_a_channel_with_the_wrong_secret_never_meets_a_member():
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    host = StoreHost("127.0.0.1", timeout_s=10)
    assert channel_namespace("s1", "a->b") != channel_namespace("s2", "a->b")
    assert "s1" not in channel_namespace("s1", "a->b")  # the secret itself is never sent to the store

    def pair(name: str, secrets: tuple[str, str], timeout_s: float):
        got: dict = {}

        def join(rank: int) -> None:
            try:
                ch = PairChannel(name, rank, host.endpoint, secret=secrets[rank], timeout_s=timeout_s,
                                 store=host.store if rank == 0 else None)
                t = torch.arange(4, dtype=torch.int64) if rank == 0 else torch.zeros(4, dtype=torch.int64)
                (ch.isend(t) if rank == 0 else ch.irecv(t)).wait()
                got[rank] = t
            except Exception as exc:  # noqa: BLE001
                got[rank] = exc

        threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return got

    good = pair("a->b", ("cluster", "cluster"), 10)
    assert torch.equal(good[1], torch.arange(4))  # members meet and the payload arrives
    t0 = time.monotonic()
    bad = pair("c->d", ("cluster", "intruder"), 2)
    assert isinstance(bad[0], Exception) and isinstance(bad[1], Exception)  # neither side accepted the other
    assert time.monotonic() - t0 < 20
