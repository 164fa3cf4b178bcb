"""Speculative decoding equals non-speculative greedy decoding; forced acceptance of 0..k."""

import pytest

from tests.conftest import make_engine, make_prompt
from workers.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("eagle", ["drop", "lossless"])
def test_mtp_speculation_equals_plain_greedy(tiny_model, eagle):
    prompts = [make_prompt(n, 40 + n) for n in (5, 70, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
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
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
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


@pytest.mark.parametrize("eagle", ["drop", "lossless"])
def test_sampled_requests_feed_the_draft_group_so_their_prefixes_hit(tiny_model, eagle):
    """A sampled request decodes without drafts, but its draft-layer KV is still written and published:
    before, the draft group held nothing for it, so every later lookup of its prefix (sampled or greedy,
    resend or next turn) reconciled to 0. Seeded sampling stays byte-identical warm vs cold.
    Alignment 64: a 185-token prompt replays from 128; with its 24 outputs the final boundary is 192."""
    prompt = make_prompt(185, 11)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = make_engine(tiny_model, num_spec_tokens=3, eagle_mode=eagle)
    assert engine.cache.alignment == 64
    (cold,) = engine.generate([prompt], sampled)
    before = engine.num_computed_prompt_tokens
    (warm,) = engine.generate([prompt], sampled)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 128
    assert engine.num_computed_prompt_tokens - before == 185 - 128  # the hit was not recomputed
    assert warm.token_ids == cold.token_ids and warm.num_draft_proposed == 0
    (g_cold,) = make_engine(tiny_model, num_spec_tokens=3, eagle_mode=eagle).generate([prompt], greedy)
    (g_warm,) = engine.generate([prompt], greedy)
    assert g_warm.num_cached_tokens == 128 and g_warm.token_ids == g_cold.token_ids
    assert g_warm.num_draft_proposed > 0
    turn2 = prompt + list(cold.token_ids) + make_prompt(30, 12)
    (t2_cold,) = make_engine(tiny_model, num_spec_tokens=3, eagle_mode=eagle).generate([turn2], sampled)
    (t2,) = engine.generate([turn2], sampled)
    # lossless: into the sampled output's blocks; drop: one unit below, as a greedy first turn gets too
    assert t2.num_cached_tokens == {"lossless": 192, "drop": 128}[eagle] and t2.token_ids == t2_cold.token_ids
