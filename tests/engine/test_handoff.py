"""Prefill/decode hand-off (workers/engine/handoff.py): a request prefilled on engine A and exported
after its first token continues on engine B token for token as on one engine, drafts included, with
B's pages equal to A's byte for byte, no prompt token run through B's model, only the pages B's own
prefix cache lacks written; A keeps its cache; mismatched engines and unprefilled requests are refused."""

import pytest
import torch

from tests.conftest import make_engine, make_prompt
from workers.engine.errors import HandoffError
from workers.engine.handoff_import import _rebuild_request
from workers.engine.sampling_params import SamplingParams

MODES = [(0, "lossless"), (3, "drop"), (3, "lossless")]  # (k, eagle): k 0 runs no MTP head
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = make_prompt(100, 3)  # 6 full blocks of 16 and a partial one; alignment 64


def engine_for(model, k, eagle, **kw):
    return make_engine(model, num_spec_tokens=k, eagle_mode=eagle, max_model_len=512,
                       cache_memory_bytes=16 * 2**20, **kw)


def prefill(engine, prompt, params=GREEDY, request_id=None) -> str:
    """Add the request and step until it has emitted its first token (several chunks: 64, 36)."""
    rid = engine.add_request(prompt, params, request_id=request_id)
    while not engine.requests[rid].output_token_ids:
        engine.step()
    return rid


def drafts_of(engine, rid) -> list[int]:
    """The drafts the request verifies next (their values read from the device when pending)."""
    req = engine.requests[rid]
    if not req.has_pending_drafts:
        return list(req.draft_token_ids)
    first = engine.pending_drafts.flat_index(req)
    return engine.pending_drafts.tokens.view(-1)[first : first + req.num_draft_tokens].tolist()


def finish(engine, rid):
    """(the final output, the drafts proposed after each step), checking the pools every step."""
    drafts, final = [], None
    while final is None:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
        engine.cache.check_integrity()
        if final is None:
            drafts.append(drafts_of(engine, rid))
    return final, drafts


def request_pages(engine, rid) -> list[torch.Tensor]:
    """Copies of what the request's pages hold for its valid positions, read from the cache tensors
    directly: target KV [0, n) and the lossless sidecar rows of its complete blocks, the working Mamba
    state, draft KV [0, n_draft)."""
    req, cache, caches = engine.requests[rid], engine.cache, engine.caches
    n, nd = req.num_computed_tokens, req.num_draft_computed_tokens
    out = []
    full = torch.tensor(cache.full.block_ids(rid))
    for k_cache, v_cache in caches.kv.values():
        out += [t.index_select(0, full).flatten(0, 1)[:n].clone() for t in (k_cache, v_cache)]
    if cache.keeps_sidecar:
        out.append(cache.sidecar.index_select(0, full[: n // cache.block_size]).clone())
    page = cache.state_page(req)
    out += [t[page].clone() for t in (*caches.conv.values(), *caches.ssm.values())]
    if cache.draft is not None:
        draft = torch.tensor(cache.draft.block_ids(rid))
        for k_cache, v_cache in caches.draft_kv.values():
            out += [t.index_select(0, draft).flatten(0, 1)[:nd].clone() for t in (k_cache, v_cache)]
    return out


def assert_same_pages(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape and torch.equal(x, y), f"page tensor {i} differs"


@pytest.mark.parametrize("k, eagle", MODES)
def test_a_handed_off_request_decodes_as_on_one_engine(tiny_model, k, eagle):
    """Wrong changes this catches: a page row missed or taken from the wrong block (the partial last
    block, the sidecar, the draft KV, the working state: compared byte for byte, and the drafts of
    every later step depend on the draft KV), drafts proposed on A lost or re-proposed (compared with
    one engine's, step by step), a prompt token recomputed on B, B's request not running, A losing
    its cached prompt (a resend hits as after a normal finish) or keeping the request."""
    ref = engine_for(tiny_model, k, eagle)
    rid = prefill(ref, PROMPT)
    ref_first_drafts = drafts_of(ref, rid)
    ref_out, ref_drafts = finish(ref, rid)

    a, b = engine_for(tiny_model, k, eagle), engine_for(tiny_model, k, eagle)
    rid = prefill(a, PROMPT, request_id="handed")
    hashes = list(a.requests[rid].hashes.hashes)
    pages = request_pages(a, rid)
    handoff = a.export_request(rid)
    assert rid not in a.requests and not a.has_unfinished()
    a.cache.check_integrity()
    assert list(handoff.meta.draft_token_ids) == ref_first_drafts and (len(ref_first_drafts) == k)

    result = b.import_request(handoff)
    assert result.num_hit_tokens == 0 and result.num_pages_written == ((7, 1, 7) if k else (7, 1))
    assert b.requests[rid].hashes.hashes == hashes
    assert_same_pages(request_pages(b, rid), pages)
    assert drafts_of(b, rid) == ref_first_drafts
    out, drafts = finish(b, rid)
    assert out.token_ids == ref_out.token_ids and drafts == ref_drafts
    assert (out.num_draft_proposed, out.num_draft_accepted) == (ref_out.num_draft_proposed, ref_out.num_draft_accepted)
    assert b.num_computed_prompt_tokens == 0 and out.num_computed_prompt_tokens == len(PROMPT)
    assert out.ttft_s is not None and out.finish_reason == "length"
    # A's prompt stays cached, as after a request that finished there
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    (resent,) = a.generate([PROMPT], one)
    assert resent.num_cached_tokens == ref.generate([PROMPT], one)[0].num_cached_tokens == 64


def test_forced_drafts_proposed_on_a_are_verified_on_b(tiny_model):
    """The tiny model's MTP drafts are never accepted, so dropping A's drafts on import changes no
    token. With drafts that are always right and 9 tokens: B verifies A's 3 drafts at its first step
    (1 + 4 + 4 tokens in 2 steps, 6 accepted, as on one engine); dropped, B decodes one token first
    (1 + 1 + 4 + 3: 3 steps, 5 accepted)."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    (plain,) = engine_for(tiny_model, 0, "lossless").generate([PROMPT], params)

    class Oracle:  # proposes the reference continuation
        num_spec_tokens = 3

        def run(self, inputs):
            out = {}
            for i in inputs:
                i.req.num_draft_computed_tokens = i.start + len(i.next_token_ids)
                if i.propose:
                    pos = len(i.req.output_token_ids)
                    out[i.req.request_id] = list(plain.token_ids[pos : pos + 3])
            return out

    (one,) = engine_for(tiny_model, 3, "lossless", drafter=Oracle()).generate([PROMPT], params)
    a, b = (engine_for(tiny_model, 3, "lossless", drafter=Oracle()) for _ in range(2))
    rid = prefill(a, PROMPT, params)
    b.import_request(a.export_request(rid))
    out, drafts = finish(b, rid)
    assert out.token_ids == one.token_ids == plain.token_ids
    assert out.num_draft_accepted == one.num_draft_accepted == 6 and len(drafts) + 1 == 2


def test_a_seeded_sampled_request_continues_its_random_stream(tiny_model):
    """Temperature 1 with a seed: B's samples continue A's generator (restarting it from the seed, or
    a fresh seed, gives other tokens)."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    (ref,) = engine_for(tiny_model, 3, "lossless").generate([PROMPT], params)
    a, b = engine_for(tiny_model, 3, "lossless"), engine_for(tiny_model, 3, "lossless")
    rid = prefill(a, PROMPT, params)
    handoff = a.export_request(rid)
    assert handoff.sampler_state is not None and handoff.meta.draft_token_ids == ()
    b.import_request(handoff)
    out, _ = finish(b, rid)
    assert out.token_ids == ref.token_ids and b.num_computed_prompt_tokens == 0


@pytest.mark.parametrize("k, eagle", MODES)
def test_b_holding_the_prefix_receives_only_the_pages_it_lacks(tiny_model, k, eagle):
    """B first served another prompt sharing 80 tokens (its Mamba state at 64 retained): the import is
    a 64-token hit on B, whose 4 target blocks (4 draft blocks; lossless: 3, the block holding 63 is
    rewritten) are B's own and not written; the bytes written are exactly the pages written (not the
    package's size). Wrong changes this catches: writing every page anyway, counting the package, a
    lossless import that keeps B's copied draft block at 63, pages written into B's shared blocks."""
    ref = engine_for(tiny_model, k, eagle)
    (ref_out,) = ref.generate([PROMPT], GREEDY)
    a = engine_for(tiny_model, k, eagle)
    rid = prefill(a, PROMPT)
    pages = request_pages(a, rid)
    handoff = a.export_request(rid)
    cold = engine_for(tiny_model, k, eagle).import_request(handoff)

    b = engine_for(tiny_model, k, eagle)
    b.generate([PROMPT[:80] + make_prompt(40, 99)], SamplingParams(temperature=0.0, max_tokens=2))
    before = b.num_computed_prompt_tokens
    warm = b.import_request(handoff)
    kv = tiny_model.kv_bytes_per_block(16) + (tiny_model.config.hidden_size * 4 if eagle == "lossless" and k else 0)
    state = tiny_model.state_bytes_per_slot()
    draft = tiny_model.draft_kv_bytes_per_block(16)
    assert warm.num_hit_tokens == 64
    if k:
        assert cold.num_pages_written == (7, 1, 7)
        assert warm.num_pages_written == (3, 1, 4 if eagle == "lossless" else 3)
    else:
        assert (cold.num_pages_written, warm.num_pages_written) == ((7, 1), (3, 1))
    for result in (cold, warm):
        pages_written = result.num_pages_written
        expect = pages_written[0] * kv + pages_written[1] * state + (pages_written[2] * draft if k else 0)
        assert result.num_bytes_written == expect
    assert warm.num_bytes_written < cold.num_bytes_written <= handoff.nbytes
    assert_same_pages(request_pages(b, rid), pages)  # B's own prefix pages equal A's too
    out, _ = finish(b, rid)
    assert out.token_ids == ref_out.token_ids and b.num_computed_prompt_tokens == before


def test_a_request_handed_off_mid_decode_keeps_its_boundary_state(tiny_model):
    """Handed off after 32 tokens (position 131, past the alignment boundary 128 its decode kept):
    B receives the boundary state with the working one, so when the request finishes B retains the
    state at 128 and the next chat turn hits 128 there, as on one engine. Dropping the boundary
    states leaves B nothing to retain (hit 0)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ref = engine_for(tiny_model, 3, "lossless")
    (ref_out,) = ref.generate([PROMPT], params)
    next_turn = PROMPT + list(ref_out.token_ids)
    a, b = engine_for(tiny_model, 3, "lossless"), engine_for(tiny_model, 3, "lossless")
    rid = prefill(a, PROMPT, params)
    while len(a.requests[rid].output_token_ids) < 32:
        a.step()
    pages = request_pages(a, rid)
    handoff = a.export_request(rid)
    assert handoff.meta.boundary_positions == (128,) and handoff.meta.num_computed_tokens == 131
    result = b.import_request(handoff)
    assert result.num_pages_written == (9, 2, 9)
    assert_same_pages(request_pages(b, rid), pages)
    out, _ = finish(b, rid)
    assert out.token_ids == ref_out.token_ids and b.num_computed_prompt_tokens == 0
    (b_turn,), (ref_turn,) = b.generate([next_turn], one), ref.generate([next_turn], one)
    assert b_turn.num_cached_tokens == ref_turn.num_cached_tokens == 128


def test_mismatched_engines_and_unprefilled_requests_are_refused(tiny_model):
    """Each mismatch is named and leaves the importer untouched; the same package then imports into a
    matching engine. A request still prefilling (or unknown) cannot be exported, and stays."""
    a = engine_for(tiny_model, 3, "lossless")
    rid = a.add_request(PROMPT, GREEDY)
    with pytest.raises(HandoffError, match="not finished its prefill"):
        a.export_request(rid)
    a.step()  # the first chunk (64 tokens): still prefilling
    with pytest.raises(HandoffError, match="not finished its prefill"):
        a.export_request(rid)
    with pytest.raises(HandoffError, match="no unfinished request"):
        a.export_request("nope")
    assert a.requests[rid].num_computed_tokens == 64
    a.step()
    handoff = a.export_request(rid)
    mismatches = [
        ("model_fingerprint", engine_for(tiny_model, 3, "lossless", model_fingerprint="other-model")),
        ("kv_block_size", engine_for(tiny_model, 3, "lossless", kv_block_size=32)),
        ("eagle_mode", engine_for(tiny_model, 3, "drop")),
        ("num_spec_tokens", engine_for(tiny_model, 2, "lossless")),
        ("num_spec_tokens", engine_for(tiny_model, 0, "lossless")),
    ]
    for field, engine in mismatches:
        free = [p.num_free_blocks for p in engine.cache.pools]
        with pytest.raises(HandoffError, match=f"mismatched engines: {field} is"):
            engine.import_request(handoff)
        assert not engine.requests and not engine.has_unfinished()
        assert [p.num_free_blocks for p in engine.cache.pools] == free
    b = engine_for(tiny_model, 3, "lossless")
    b.import_request(handoff)
    with pytest.raises(HandoffError, match="already on this engine"):
        b.import_request(handoff)
    assert b.has_unfinished()


@pytest.mark.parametrize("k, eagle", MODES)
def test_b_holding_only_the_prefix_kv_shares_it_without_a_mamba_state_there(tiny_model, k, eagle):
    """B decoded this prompt before from a hand-off, so it caches the prompt's KV blocks but holds no
    Mamba state at 64 (it never prefilled: its states sit at its own decode boundaries), and its
    reconciled hit is 0. A second hand-off of the prompt shares B's KV up to 64 anyway: the package
    brings the working state. Catches: an import admitted at the reconciled hit (nothing shared,
    every page written), KV shared past what every attention group serves (pages or output differ)."""
    ref = engine_for(tiny_model, k, eagle)
    (ref_out,) = ref.generate([PROMPT], GREEDY)
    b = engine_for(tiny_model, k, eagle)
    first = engine_for(tiny_model, k, eagle)
    b.import_request(first.export_request(prefill(first, PROMPT, request_id="first")))
    finish(b, "first")
    a = engine_for(tiny_model, k, eagle)
    rid = prefill(a, PROMPT, request_id="second")
    pages = request_pages(a, rid)
    handoff = a.export_request(rid)
    lookup = b.cache.lookup(_rebuild_request(b, handoff.meta))
    assert (lookup.hit_tokens, lookup.attention_match_tokens) == (0, 64)
    result = b.import_request(handoff)
    assert result.num_hit_tokens == 64
    assert result.num_pages_written[0] == 3  # of 7 target blocks: 4 shared
    assert_same_pages(request_pages(b, rid), pages)
    out, _ = finish(b, rid)
    assert out.token_ids == ref_out.token_ids and b.num_computed_prompt_tokens == 0
