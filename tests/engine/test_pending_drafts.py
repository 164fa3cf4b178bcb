"""MTP drafts stay on the device between steps: the next step writes them into its input ids there and
reads their values with its argmax rows in one copy; a request preempted meanwhile gets none."""

import torch

from bench.host_counters import HostCounter
from tests.conftest import make_engine, make_prompt
from workers.engine.drafter import DeviceDrafts, PendingDrafts
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.engine.step_inputs import StepLogits


def _req(rid: str, num_drafts: int) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(temperature=0.0), hashes=None)
    req.num_draft_tokens = num_drafts
    return req


def test_read_back_is_one_copy_and_delivers_each_request_its_drafts():
    a, b, preempted = _req("a", 3), _req("b", 1), _req("c", 3)
    pending = PendingDrafts()
    pending.set(DeviceDrafts(torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]]), ("a", "b", "c")), [a, b, preempted])
    assert pending.flat_index(b) == 3
    preempted.set_drafts([])  # the scheduler preempted it: it drops its drafts
    logits = StepLogits(torch.tensor([[0.0, 2.0], [3.0, 1.0]]), [(0, 2)])
    with HostCounter() as counter:
        logits.read_back(pending)
    assert counter.counts().num_syncs == 1
    assert logits.argmax == [1, 0]
    assert a.draft_token_ids == [5, 6, 7] and b.draft_token_ids == [8] and preempted.draft_token_ids == []
    assert not pending and not a.has_pending_drafts and not preempted.has_pending_drafts


def test_speculative_engine_reads_the_device_once_per_decode_step(tiny_model):
    """k=3 with the MTP head: after the prefill every step is one copy; outputs equal k=0."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [make_prompt(40, s) for s in (1, 2, 3)]
    plain = make_engine(tiny_model, num_spec_tokens=0).generate(prompts, params)
    engine = make_engine(tiny_model, num_spec_tokens=3)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()  # the prefills
    assert engine.pending_drafts  # their drafts wait on the device
    done, syncs = {}, []
    while engine.has_unfinished():
        with HostCounter() as counter:
            outs = engine.step()
        syncs.append(counter.counts().num_syncs)
        done.update({o.request_id: o for o in outs if o.finished})
    assert max(syncs) == 1 and len(syncs) >= 3
    assert [done[i].token_ids for i in ids] == [o.token_ids for o in plain]
    assert all(done[i].num_draft_proposed > 0 for i in ids)
