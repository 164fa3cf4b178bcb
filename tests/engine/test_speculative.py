"""Speculative decoding equals non-speculative greedy decoding; forced acceptance of 0..k."""

import pytest

from tests.conftest import make_engine, make_prompt
from workers.engine.sampling import SamplingParams


@pytest.mark.parametrize("eagle", ["drop", "lossless"])
def test_mtp_speculation_equals_plain_greedy(tiny_model, eagle):
    prompts = [make_prompt(n, 40 + n) for n in (5, 70, 200)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = make_engine(tiny_model, num_spec_tokens=0).generate(prompts, params)
    spec = make_engine(tiny_model, num_spec_tokens=3, eagle_mode=eagle).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.num_draft_proposed > 0 for o in spec)


class ForcedDrafter:
    """Proposes the reference continuation for the first j drafts, then wrong tokens; j cycles 0..k."""

    def __init__(self, reference: list[int], k: int, vocab: int) -> None:
        self.reference, self.num_spec_tokens, self.vocab = reference, k, vocab
        self.step = 0
        self.planned: list[int] = []

    def run(self, inputs):
        out = {}
        for i in inputs:
            i.req.num_draft_computed_tokens = i.start + len(i.next_token_ids)
            if not i.propose:
                continue
            j = self.step % (self.num_spec_tokens + 1)
            self.step += 1
            pos = len(i.req.output_token_ids)  # index of the token after the last one emitted
            right = self.reference[pos : pos + self.num_spec_tokens]
            drafts = [right[d] if d < j else (right[d] + 1) % self.vocab for d in range(len(right))]
            self.planned.append(min(j, len(right)))
            out[i.req.request_id] = drafts
        return out


def test_forced_acceptance_of_0_to_k_tokens_with_mamba_rollback(tiny_model):
    k = 3
    prompt = make_prompt(90, 7)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    (ref,) = make_engine(tiny_model, num_spec_tokens=0).generate([prompt], params)
    drafter = ForcedDrafter(list(ref.token_ids), k, 512)
    engine = make_engine(tiny_model, num_spec_tokens=k, drafter=drafter)
    engine.add_request(prompt, params, request_id="r")
    accepted_per_step, last = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.num_draft_accepted != last or out.new_token_ids:
                accepted_per_step.append(out.num_draft_accepted - last)
                last = out.num_draft_accepted
            final = out
    assert final.token_ids == ref.token_ids
    assert set(accepted_per_step[1:]) >= set(range(k + 1))  # every acceptance count 0..k happened
    assert final.num_draft_accepted == sum(accepted_per_step)
