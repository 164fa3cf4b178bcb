"""Roles under the autoscaler on a real Ray cluster (`cluster.pd` prefill 1-2, decode 1-2, starting
1:1): a killed decode replica is replaced by a decode replica (BELOW_MIN), decoding streams add a
decode replica while prefill has room (QUEUE_DEPTH; `role_of`'s default rule would have made it a
prefill replica), none beyond max_decode, prefill queues add a prefill replica. Each new replica
shows its role in the front door's membership and serves as it: every request finishes with one
in-process engine's tokens, a new decoder decodes hand-offs without computing a prompt token, the
new prefill replica prefills."""

import time

import pytest

from bench.fault_doubles import kill_replica
from tests.conftest import make_prompt
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(240)]

ENGINE = EngineConfig(kernels="torch", max_model_len=2048, cache_memory_bytes=32 * 2**20, num_spec_tokens=0)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)  # streams decoding for seconds
DEADLINE_S = 60.0
LOAD_ROUNDS = 5  # batches of long prompts tried before the prefill queue is called never deep


def _reference(tiny_dir, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    engine = LLMEngine.from_checkpoint(tiny_dir, ENGINE)
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    done: dict[str, tuple[int, ...]] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[r] for r in ids]


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        time.sleep(0.1)


def test_each_role_scales_as_itself_and_its_new_replica_serves(ray_session, tiny_dir):
    from cluster.config import ClusterConfig, PDConfig
    from cluster.control.replica_roles import DECODE, PREFILL
    from cluster.control.scale_policy import ScaleAction, ScaleReason
    from cluster.frontdoor.backend import ClusterBackend

    ray = ray_session
    pd = PDConfig(1, 1, max_prefill=2, max_decode=2)
    config = ClusterConfig(name=None, num_replicas=2, pd=pd, health_interval_s=0.5, autoscale_interval_s=3600,
                           scale_up_queue_depth=2.0, scale_down_idle_s=3600)  # stepped here, never idle
    backend = ClusterBackend(tiny_dir, ENGINE, config)
    try:
        def role_ids(role: str) -> tuple[str, ...]:
            return ray.get(backend.controller.role_loads.remote())[role].replica_ids

        def work(replica_id: str) -> int:
            return ray.get(backend.replicas.get(replica_id).actor.work_counts.remote()).num_computed_prompt_tokens

        (prefill,), (decode,) = role_ids(PREFILL), role_ids(DECODE)
        prompts = [make_prompt(120 + 16 * i, 40 + i) for i in range(3)]
        expect = _reference(tiny_dir, prompts)

        # a decode replica dies: the autoscaler's replacement is a decode replica, and it decodes
        kill_replica(backend, decode)
        _wait(lambda: role_ids(DECODE) == (), "the dead decode replica purged")
        event = backend.autoscaler.step()
        assert (event.action, event.reason, event.role) == (ScaleAction.UP, ScaleReason.BELOW_MIN, DECODE)
        new_decode = event.replica_id
        assert role_ids(DECODE) == (new_decode,) and role_ids(PREFILL) == (prefill,)
        assert backend.replicas.get(new_decode).role == DECODE  # what the front door routes by
        handoffs = ray.get(backend.controller.stats.remote())["handoffs"]
        finals = [backend.generate(p, PARAMS) for p in prompts]
        assert [o.token_ids for o, _ in finals] == expect and all(o.finished for o, _ in finals)
        assert {served for _, served in finals} == {new_decode}  # handed off to it, decoded there
        assert ray.get(backend.controller.stats.remote())["handoffs"] == handoffs + len(prompts)
        assert work(new_decode) == 0 and work(prefill) == sum(len(p) for p in prompts)

        # decoding streams (short prompts, long outputs) while prefill has room: a decode replica
        streams = [backend.submit(make_prompt(24, 60 + i), LONG) for i in range(6)]
        _wait(lambda: [load.num_unfinished for load in ray.get(backend.controller.role_loads.remote()).values()]
              == [0, 6], "every stream decoding, none waiting for prefill")
        event = backend.autoscaler.step()
        assert (event.action, event.reason, event.role) == (ScaleAction.UP, ScaleReason.QUEUE_DEPTH, DECODE)
        assert event.depth == 6.0 and event.warmed == 0
        second_decode = event.replica_id
        assert backend.replicas.get(second_decode).role == DECODE and role_ids(PREFILL) == (prefill,)
        for s in streams:
            assert list(s)[-1].finished
        with pytest.raises(Exception, match=r"at most 2 decode replicas \(cluster.pd.max_decode\)"):
            backend.add_replicas(1, role=DECODE)  # refused before anything starts
        kill_replica(backend, new_decode)  # the new decoder alone now: it must take every hand-off
        # purged by the controller and gone from this front door's membership (polled): a decoder it
        # still listed would be picked, refuse the hand-off, and the prefill replica would decode
        _wait(lambda: role_ids(DECODE) == (second_decode,) and backend.replicas.get(new_decode) is None,
              "the first decoder purged, here too")
        finals = [backend.generate(p, PARAMS) for p in prompts]
        assert [o.token_ids for o, _ in finals] == expect
        assert {served for _, served in finals} == {second_decode} and work(second_decode) == 0

        # deep prefill queues (long prompts, short outputs): a prefill replica, not a decode one
        event = None
        for round_ in range(LOAD_ROUNDS):
            streams = [backend.submit(make_prompt(1500, 100 * round_ + i), PARAMS) for i in range(8)]
            event = backend.autoscaler.step()
            for s in streams:
                assert list(s)[-1].finished
            if event.action is not ScaleAction.NONE:
                break
        assert (event.action, event.reason, event.role) == (ScaleAction.UP, ScaleReason.QUEUE_DEPTH, PREFILL)
        new_prefill = event.replica_id
        assert set(role_ids(PREFILL)) == {prefill, new_prefill} and role_ids(DECODE) == (second_decode,)
        assert backend.replicas.get(new_prefill).role == PREFILL
        fresh = [make_prompt(100 + 8 * i, 90 + i) for i in range(2)]
        before = work(new_prefill)
        finals = [backend.generate(p, PARAMS, replica_id=new_prefill) for p in fresh]  # its prefill, forced
        assert [o.token_ids for o, _ in finals] == _reference(tiny_dir, fresh)
        assert {served for _, served in finals} == {second_decode}
        assert work(new_prefill) - before == sum(len(p) for p in fresh) and work(second_decode) == 0
        assert len(backend.autoscaler.history) == 3  # one action per step, nothing else scaled
    finally:
        backend.shutdown()
