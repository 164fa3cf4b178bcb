"""Real Ray on loopback: replica actors + the cache-service actor behind `ClusterBackend`:
routing by hybrid hits, transfers, replica death, cache-service death and rebuild."""

import threading
import time

import pytest

from bench.fault_doubles import kill_cache_service, kill_replica
from tests.conftest import make_prompt
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONFIG = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=64 * 2**20)


def _backend(tiny_dir, **kw):
    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend

    return ClusterBackend(tiny_dir, CONFIG, ClusterConfig(name=None, num_replicas=2, **kw))


def test_resend_routed_to_the_holder_hits_and_replica_death_loses_nothing(ray_session, tiny_dir):
    backend = _backend(tiny_dir)
    try:
        prompt = make_prompt(600, 1)
        cold, holder = backend.generate(prompt, PARAMS)
        warm, again = backend.generate(prompt, PARAMS)
        assert cold.num_cached_tokens == 0 and cold.num_computed_prompt_tokens == 600
        assert again == holder and warm.num_cached_tokens == 576  # floor(599 / 64) * 64, lossless: no drop
        assert warm.token_ids == cold.token_ids and warm.num_computed_prompt_tokens == 600 - 576
        other = next(r for r in backend.replica_ids if r != holder)
        work = ray_session.get(backend.replicas.get(other).actor.work_counts.remote())
        forced, served = backend.generate(prompt, PARAMS, replica_id=other)  # the holder's pages move first
        assert served == other and backend.counters["transfers"] == 1
        assert forced.token_ids == cold.token_ids and forced.num_cached_tokens == 576
        # after the transfer the receiver computes only the rest, as its engine and its model count it
        after = ray_session.get(backend.replicas.get(other).actor.work_counts.remote())
        assert forced.num_computed_prompt_tokens == 600 - 576
        assert after.num_computed_prompt_tokens - work.num_computed_prompt_tokens == 600 - 576
        assert after.ranks[0].num_prompt_tokens - work.ranks[0].num_prompt_tokens == 600 - 576
        # kill the holder: the next request (forced there) is served by the survivor, nothing lost
        kill_replica(backend, holder)
        last, served = backend.generate(prompt, PARAMS, replica_id=holder)
        assert served == other and last.token_ids == cold.token_ids and last.num_cached_tokens == 576
        assert holder not in backend.replica_ids and other in backend.replica_ids  # (a replacement may be starting)
        assert holder not in backend.service_stats()["replicas"]  # the dead replica was purged
    finally:
        backend.shutdown()


@pytest.mark.chaos  # a replica killed under load: make chaos (the resend test above kills one idle)
def test_replica_killed_under_load_loses_no_request_and_outputs_match(ray_session, tiny_dir):
    backend = _backend(tiny_dir)
    try:
        prompts = [make_prompt(300 + 40 * i, 20 + i) for i in range(6)]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        cold = [backend.generate(p, params)[0].token_ids for p in prompts]
        streams = [backend.submit(p, params) for p in prompts]
        # the victim must hold streams, so a stream (not only a health check) finds the death: wait
        # until every request is placed, then take the replica with the most of them
        deadline = time.monotonic() + 10  # placing takes milliseconds; a request may finish first
        while (sum(backend.replicas.get(r).num_inflight for r in backend.replica_ids) < len(prompts)
               and time.monotonic() < deadline):
            time.sleep(0.01)
        victim = max(backend.replica_ids, key=lambda r: backend.replicas.get(r).num_inflight)
        killer = threading.Timer(0.3, kill_replica, args=(backend, victim))
        killer.start()
        outs = [list(s) for s in streams]  # every accepted request completes
        killer.join()
        for out, expect in zip(outs, cold):
            assert out[-1].finished and out[-1].token_ids == expect
            streamed = [t for o in out for t in o.new_token_ids]
            assert streamed == list(expect)  # no token twice, none missing, across the retry
        assert victim not in backend.replica_ids
        assert backend.counters["replica_deaths"] == 1 and backend.counters["retries"] >= 1  # killed mid-stream
    finally:
        backend.shutdown()


def test_cache_service_death_routes_by_load_then_rebuilds_from_replicas(ray_session, tiny_dir):
    backend = _backend(tiny_dir)
    try:
        prompt = make_prompt(600, 3)
        cold, holder = backend.generate(prompt, PARAMS)
        epoch = backend.service_stats()["epoch"]
        kill_cache_service(backend)
        during, _ = backend.generate(make_prompt(200, 4), PARAMS)  # served while the service restarts
        assert during.finished
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # Ray restarts it; pushes resync every replica into it
            try:
                stats = backend.service_stats()
            except Exception:  # still restarting
                stats = None
            if (stats and stats["epoch"] != epoch and sorted(stats["replicas"]) == backend.replica_ids
                    and not any(r["stale"] for r in stats["replicas"].values())
                    and stats["replicas"][holder]["entries"][1]):
                break
            backend.generate(make_prompt(40, 5), PARAMS)  # traffic: steps push event batches
            time.sleep(0.5)
        assert stats["epoch"] != epoch  # a restarted service...
        assert sorted(stats["replicas"]) == backend.replica_ids  # ...rebuilt from the live replicas
        # routed by the rebuilt index (not by load): a full hit on a replica holding the prefix
        # (a request load-routed during the restart may have left a copy on the other one too)
        warm, served = backend.generate(prompt, PARAMS)
        assert warm.num_cached_tokens == 576 and warm.token_ids == cold.token_ids
    finally:
        backend.shutdown()


def test_concurrent_transfers_between_the_same_pair_do_not_interleave(ray_session, tiny_dir):
    """Regression: two requests moving pages holder -> other at once shared one channel and
    deadlocked until gloo's timeout; transfers on a pair are now serialised."""

    from cluster.http.metrics import Metrics

    backend = _backend(tiny_dir)
    metrics = backend.metrics = Metrics()
    try:
        prompts = [make_prompt(400, 90 + i) for i in range(3)]
        colds = [backend.generate(p, PARAMS, replica_id=backend.replica_ids[0])[0] for p in prompts]
        src, dst = backend.replica_ids
        hit = 384
        results = [None] * len(prompts)

        def move(i):
            results[i] = backend.transfer(prompts[i], None, src, dst, hit)

        threads = [threading.Thread(target=move, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == [True] * len(prompts)  # none hung (join timeout); the time is a benchmark figure
        # the bytes each source streamed reach the front door's metrics: every page of each hit
        from bench.gpu_check_measure import prefix_nbytes
        from workers.engine.engine import LLMEngine

        page_bytes = prefix_nbytes(LLMEngine.from_checkpoint(tiny_dir, CONFIG).cache, hit)
        sent = metrics.registry.get_sample_value("hybridserve_transfer_bytes_total")
        assert page_bytes > 0 and sent == len(prompts) * page_bytes
        assert metrics.registry.get_sample_value("hybridserve_transfers_total", {"outcome": "ok"}) == len(prompts)
        for p, cold in zip(prompts, colds):
            warm, served = backend.generate(p, PARAMS, replica_id=dst)
            assert served == dst and warm.num_cached_tokens == hit and warm.token_ids == cold.token_ids
    finally:
        backend.shutdown()


def test_prompts_served_through_submit_warm_a_new_replica(ray_session, tiny_dir):
    """Regression: only `generate` (tests) recorded hot prefixes, so HTTP traffic never warmed
    an autoscaled replica."""
    from cluster.config import ClusterConfig
    from cluster.frontdoor.backend import ClusterBackend

    backend = ClusterBackend(tiny_dir, CONFIG, ClusterConfig(name=None, num_replicas=1))
    try:
        prompt = make_prompt(500, 95)
        cold = list(backend.submit(prompt, PARAMS))[-1]  # the front end's path
        (new,) = backend.add_replicas(1)
        assert backend.warm(new) == 1
        warm, served = backend.generate(prompt, PARAMS, replica_id=new)
        assert served == new and warm.num_cached_tokens == 448 and warm.token_ids == cold.token_ids
    finally:
        backend.shutdown()
