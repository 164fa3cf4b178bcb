"""Prefill/decode disaggregation through a real 2-replica Ray cluster (`cluster.pd` 1:1): each
request prefills on the prefill replica, is handed off after its first token over the replicas'
pair channel, and decodes on the decode replica; outputs equal one in-process engine's token for
token, nothing is streamed twice, the decoder computes no prompt token, and a corrupted hand-off
finishes on the prefill replica with the same output."""

import os
import time

import pytest

from bench.fault_doubles import HandoffCorruptingReplica
from cluster.http.metrics import Metrics
from tests.conftest import make_prompt
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(240)]

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [make_prompt(150, 7), make_prompt(90, 8)]


def _config(k: int) -> EngineConfig:
    return EngineConfig(kernels="torch", max_model_len=512, cache_memory_bytes=16 * 2**20, num_spec_tokens=k,
                        eagle_mode="lossless")


def _reference(tiny_dir, k: int, prompt: list[int]) -> tuple[int, ...]:
    engine = LLMEngine.from_checkpoint(tiny_dir, _config(k))
    rid = engine.add_request(prompt, PARAMS)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.token_ids


@pytest.fixture(scope="module", params=[0, 3], ids=["k0", "k3-lossless"])
def pd_cluster(request, ray_session, tiny_dir):
    from cluster.config import ClusterConfig, PDConfig
    from cluster.frontdoor.backend import ClusterBackend

    k = request.param
    cpus = sorted(os.sched_getaffinity(0))  # prefill on the first, decode on the last (one CPU: both there)
    pd = PDConfig(num_prefill=1, num_decode=1, prefill_cpus=str(cpus[0]), decode_cpus=str(cpus[-1]))
    backend = ClusterBackend(tiny_dir, _config(k), ClusterConfig(name=None, num_replicas=2, pd=pd),
                             replica_cls=HandoffCorruptingReplica)
    roles = {rep.role: r for r, rep in backend.replicas.replicas.items()}
    yield k, backend, roles["prefill"], roles["decode"]
    backend.shutdown()


def _work(ray_session, backend, replica_id: str) -> int:
    return ray_session.get(backend.replicas.get(replica_id).actor.work_counts.remote()).num_computed_prompt_tokens


def test_pd_outputs_equal_one_engine_and_the_decoder_computes_no_prompt(pd_cluster, ray_session, tiny_dir):
    # catches: a hand-off that loses or repeats a token (first token from A, rest from B), decoding
    # that diverges after the import (sampler, drafts, pages), the decoder re-running the prompt, the
    # front door routing prefill to the decode replica, usage counters taken from the wrong side
    k, backend, prefill, decode = pd_cluster
    for prompt in PROMPTS:
        expect = _reference(tiny_dir, k, prompt)
        before = _work(ray_session, backend, decode)
        stream = backend.submit(prompt, PARAMS)
        outs = list(stream)
        final = outs[-1]
        assert final.finished and final.token_ids == expect
        assert [t for o in outs for t in o.new_token_ids] == list(expect)  # nothing twice, nothing lost
        assert final.num_prompt_tokens == len(prompt) and final.num_computed_prompt_tokens == len(prompt)
        assert final.num_cached_tokens == 0 and final.finish_reason == "length"
        assert _work(ray_session, backend, decode) == before == 0
    assert _work(ray_session, backend, prefill) == sum(len(p) for p in PROMPTS)
    assert (backend.handoff_counts["handoffs"], backend.handoff_counts["handoffs_kept"]) == (len(PROMPTS), 0)
    metrics = Metrics()  # /metrics: the controller's hand-off counts
    metrics.attach_cluster_counters(backend.status.controller_counters)
    assert metrics.registry.get_sample_value("hybridserve_handoffs_total") == len(PROMPTS)
    assert metrics.registry.get_sample_value("hybridserve_handoffs_kept_total") == 0
    stats = ray_session.get(backend.replicas.get(decode).actor.engine_stats.remote())
    assert stats["num_steps"] > 0  # the decoder did decode


def _package(tiny_dir, k: int, prompt: list[int]):
    """The hand-off package of `prompt` after its first token, exported from an in-process engine."""
    from tests.engine.test_handoff import prefill

    engine = LLMEngine.from_checkpoint(tiny_dir, _config(k))
    return engine.export_request(prefill(engine, prompt, params=PARAMS))


def test_resend_hits_on_the_prefill_replica_and_reports_cached_tokens(pd_cluster, ray_session, tiny_dir):
    # catches: cached_tokens lost or recomputed across the hand-off (the importer's counters), or
    # the export dropping the prefill replica's cache (the request is finished there as HANDOFF);
    # and a hand-off that sends the decoder rows it already holds: it decoded this prompt before
    # (the first test), so its own hit of 128 spares 8 target blocks (and 7 draft blocks: lossless
    # rewrites the one holding 127), counted by the controller against the whole package's size
    k, backend, prefill, decode = pd_cluster
    prompt = PROMPTS[0]
    before = ray_session.get(backend.controller.stats.remote())
    final, served = backend.generate(prompt, PARAMS)
    assert served == decode and final.token_ids == _reference(tiny_dir, k, prompt)
    assert final.num_cached_tokens == 128  # floor(149 / 64) * 64: A's prompt pages stayed cached
    assert final.num_computed_prompt_tokens == len(prompt) - 128
    after = ray_session.get(backend.controller.stats.remote())
    sent, skipped = (after[key] - before[key] for key in ("handoff_bytes", "handoff_skipped_bytes"))
    package = _package(tiny_dir, k, prompt)
    row = [sum(t[0].numel() * t.element_size() for t in group) for group in package.pages]
    assert skipped == 8 * row[0] + (7 * row[2] if k else 0)
    assert sent + skipped == package.nbytes  # greedy: no sampler state on the wire


def test_corrupted_hand_off_finishes_on_the_prefill_replica(pd_cluster, ray_session, tiny_dir):
    # catches: a failed hand-off that loses the request (no fallback), streams the first token twice,
    # or hangs; and a decoder that imports a corrupted package (it must refuse it)
    k, backend, prefill, decode = pd_cluster
    prompt = make_prompt(120, 9)
    before = backend.handoff_counts["handoffs_kept"]
    stream = backend.submit(prompt, PARAMS, request_id=f"corrupt-{k}")
    outs = list(stream)
    expect = _reference(tiny_dir, k, prompt)
    assert outs[-1].finished and outs[-1].token_ids == expect
    assert [t for o in outs for t in o.new_token_ids] == list(expect)
    assert backend.handoff_counts["handoffs_kept"] == before + 1
    assert ray_session.get(backend.controller.stats.remote())["handoffs_kept"] == before + 1  # and the controller
    # the failed channel is closed on both ends (a leak otherwise: one per failure), and the next
    # hand-off opens a fresh one and is delivered
    old = f"{prefill}->{decode}#h{before}"
    for replica in (prefill, decode):
        actor = backend.replicas.get(replica).actor
        deadline = time.monotonic() + 30
        while old in ray_session.get(actor.channel_names.remote()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert old not in ray_session.get(actor.channel_names.remote())
    delivered = backend.handoff_counts["handoffs"]
    _, served = backend.generate(make_prompt(60, 10), PARAMS)
    assert served == decode and backend.handoff_counts["handoffs"] == delivered + 1
    fresh = ray_session.get(backend.replicas.get(decode).actor.channel_names.remote())
    assert f"{prefill}->{decode}#h{before + 1}" in fresh
    # every reservation given back: the decoder reserved at the prefill's start of the kept request
    # (a leak would skew decode placement away from it for good), the prefill replica's counts too
    assert {r: rep.num_inflight for r, rep in backend.replicas.replicas.items()} == {prefill: 0, decode: 0}


def _pair_channels(ray_session, backend, replica: str, src: str, dst: str, kind: str) -> list[str]:
    """The channels src -> dst open on `replica`, of one kind: "#<gen>" prefix transfers, "#h<gen>" hand-offs."""
    names = ray_session.get(backend.replicas.get(replica).actor.channel_names.remote())
    pair = [n for n in names if n.startswith(f"{src}->{dst}#")]
    return [n for n in pair if n.startswith(f"{src}->{dst}#h") == (kind == "handoff")]


def test_hand_off_after_a_failed_early_page_send(pd_cluster, ray_session, tiny_dir):
    # catches: a failed kv-only transfer (an early page send of a prompt still prefilling) whose
    # renewal drops the pair's hand-off channel too (both ends used to drop every channel with the
    # other) while the hand-offs' book still names it: the next hand-off reopened a channel of the
    # dropped one's name, whose rendezvous met its keys left in the sender's store (gloo: connection
    # refused, the hand-off timed out and the prefill replica was purged with the request on it)
    from cluster.messages import TransferMsg

    k, backend, prefill, decode = pd_cluster
    _, served = backend.generate(make_prompt(60, 12), PARAMS)  # a hand-off channel open on both ends
    assert served == decode
    def channels(replica: str, kind: str) -> list[str]:
        return _pair_channels(ray_session, backend, replica, prefill, decode, kind)

    handoff_channels = {r: channels(r, "handoff") for r in (prefill, decode)}
    assert all(handoff_channels.values())
    failures = ray_session.get(backend.controller.stats.remote())["transfer_failures"]
    # the early send of a prompt whose pages the prefill replica no longer holds (evicted): refused
    early = TransferMsg(tuple(make_prompt(128, 13)), None, prefill, decode, 64, kv_only=True)
    assert not ray_session.get(backend.controller.transfer.remote(early)).ok
    assert ray_session.get(backend.controller.stats.remote())["transfer_failures"] == failures + 1
    for replica in (prefill, decode):  # the failed channel dropped on both ends (not waited for: wait here)
        deadline = time.monotonic() + 30
        while channels(replica, "transfer") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not channels(replica, "transfer")
        # the hand-off channel left alone (whether a reopened name meets stale keys is a race: this is not)
        assert channels(replica, "handoff") == handoff_channels[replica]
    delivered, kept = backend.handoff_counts["handoffs"], backend.handoff_counts["handoffs_kept"]
    prompt = make_prompt(90, 14)
    outs = list(backend.submit(prompt, PARAMS))
    expect = _reference(tiny_dir, k, prompt)
    assert outs[-1].finished and outs[-1].token_ids == expect
    assert [t for o in outs for t in o.new_token_ids] == list(expect)
    assert (backend.handoff_counts["handoffs"], backend.handoff_counts["handoffs_kept"]) == (delivered + 1, kept)
    assert {r: rep.num_inflight for r, rep in backend.replicas.replicas.items()} == {prefill: 0, decode: 0}


def test_each_role_runs_on_its_cpus(pd_cluster):
    # catches: roles not pinned (cluster.pd.<role>_cpus ignored), only the replica's main thread
    # pinned (the engine loop is another thread), the roles' lists swapped
    k, backend, prefill, decode = pd_cluster
    cpus = sorted(os.sched_getaffinity(0))
    for replica, cpu in ((prefill, cpus[0]), (decode, cpus[-1])):
        pid = backend.replicas.get(replica).info.pid
        threads = os.listdir(f"/proc/{pid}/task")
        assert len(threads) > 1 and {tuple(os.sched_getaffinity(int(t))) for t in threads} == {(cpu,)}


def test_prompt_pages_go_to_the_decoder_while_the_prompt_prefills(ray_session, tiny_dir):
    """A 320-token prompt prefilled in chunks (`max_num_batched_tokens` 80) on a fresh P/D
    cluster: the decoder is chosen as the prefill starts and each finished chunk's attention blocks
    go to it while the next computes (kv-only transfers), so the hand-off itself skips them. Catches:
    no early sends (the count), early pages the hand-off does not use (skipped bytes 0: the
    decoder never saw this prompt otherwise), pages sent twice (sent + skipped == the package),
    and early pages that change the output (compared with one engine prefilling in the same chunks)."""
    from cluster.config import ClusterConfig, PDConfig
    from cluster.frontdoor.backend import ClusterBackend

    config = _config(3).replace(max_num_batched_tokens=80)
    prompt = make_prompt(320, 11)
    engine = LLMEngine.from_checkpoint(tiny_dir, config)
    (want,) = engine.generate([prompt], PARAMS)
    backend = ClusterBackend(tiny_dir, config, ClusterConfig(name=None, num_replicas=2,
                                                             pd=PDConfig(num_prefill=1, num_decode=1)))
    try:
        roles = {rep.role: r for r, rep in backend.replicas.replicas.items()}
        outs = list(backend.submit(prompt, PARAMS))
        assert outs[-1].finished and outs[-1].token_ids == want.token_ids
        assert [t for o in outs for t in o.new_token_ids] == list(want.token_ids)
        assert backend.handoff_counts["handoffs"] == 1 and backend.handoff_counts["early_page_sends"] >= 1
        stats = ray_session.get(backend.controller.stats.remote())
        assert stats["transfers"] >= 1 and stats["handoff_skipped_bytes"] > 0
        package = _package(tiny_dir, 3, prompt)
        assert stats["handoff_bytes"] + stats["handoff_skipped_bytes"] == package.nbytes
        assert _work(ray_session, backend, roles["decode"]) == 0
        assert all(rep.num_inflight == 0 for rep in backend.replicas.replicas.values())
    finally:
        backend.shutdown()
