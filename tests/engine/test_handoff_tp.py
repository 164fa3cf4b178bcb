"""A hand-off between two tensor-parallel engines (TP 2, rank 1 of each a spawned process, gloo on
loopback; the shipped trained checkpoint, whose MTP head accepts drafts): each rank's shard of every
page travels (`workers/model/tp_pages.py`), the decoder's pages equal the exporter's on every rank
byte for byte, and its greedy output equals one engine's, for k = 0, k = 3 drop and k = 3 lossless.
A TP 2 package is refused by a TP 1 engine by name."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_engine
from tests.model.tp_helpers import TRAINED, code_prompts
from workers.engine.errors import HandoffError
from workers.engine.page_tensors import read_rows
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import load_model
from workers.tp_worker import launch_local_tp

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = code_prompts()[2][:150]  # 2 Mamba pages of 64 and a partial one; 9 full KV blocks of 16 and a partial


@pytest.fixture(scope="module")
def tp_pair():
    torch.set_num_threads(1)
    a, b = launch_local_tp(str(TRAINED), 2), launch_local_tp(str(TRAINED), 2)
    yield a, b
    a.close()
    b.close()


def _engine(model, k: int, eagle: str):
    return make_engine(model, num_spec_tokens=k, eagle_mode=eagle, max_model_len=512, cache_memory_bytes=16 * 2**20)


def _prefill(engine, prompt) -> str:
    rid = engine.add_request(prompt, PARAMS)
    while not engine.requests[rid].output_token_ids:
        engine.step()
    return rid


def _finish(engine, rid):
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def _request_rows(engine, rid) -> list[tuple[torch.Tensor, ...]]:
    """Every rank's rows of the request's pages, per group, as a hand-off reads them."""
    from workers.engine.handoff import _request_pages

    cache = engine.cache
    return [read_rows(cache, g, ids, cache.keeps_sidecar)
            for g, ids in enumerate(_request_pages(cache, engine.requests[rid]))]


@pytest.mark.parametrize("k, eagle", [(0, "lossless"), (3, "drop"), (3, "lossless")],
                         ids=["k0", "k3-drop", "k3-lossless"])
def test_a_tp2_hand_off_decodes_as_one_engine_with_every_ranks_pages(tp_pair, k, eagle):
    """Catches: only rank 0's shard carried or written (rank 1's pages would differ and the output
    with them), ranks' shards swapped (the rows are compared per rank), a sidecar or draft page
    left behind, and a decoder that recomputes the prompt."""
    tp_a, tp_b = tp_pair
    trained = load_model(TRAINED, kernels="torch")
    (ref,) = _engine(trained, k, eagle).generate([PROMPT], PARAMS)
    a = _engine(tp_a, k, eagle)
    rid = _prefill(a, PROMPT)
    handoff = a.export_request(rid)
    assert handoff.meta.engine.tp_size == 2
    assert len(handoff.pages[0]) == 2 * 2 * 2 + (1 if k and eagle == "lossless" else 0)  # ranks x layers x K,V
    b = _engine(tp_b, k, eagle)
    result = b.import_request(handoff)
    assert result.num_hit_tokens == 0 and result.num_bytes_written == handoff.nbytes
    for got, sent in zip(_request_rows(b, rid), handoff.pages):
        assert len(got) == len(sent)
        for i, (x, y) in enumerate(zip(got, sent)):
            assert torch.equal(x, y), f"page tensor {i} differs"
    out = _finish(b, rid)
    assert out.token_ids == ref.token_ids
    assert (out.num_draft_proposed, out.num_draft_accepted) == (ref.num_draft_proposed, ref.num_draft_accepted)
    assert b.num_computed_prompt_tokens == 0
    if k:
        assert out.num_draft_accepted > 0  # the drafts really ran across the hand-off


def test_a_tp1_engine_refuses_a_tp2_package(tp_pair):
    tp_a, _ = tp_pair
    a = _engine(tp_a, 0, "lossless")
    handoff = a.export_request(_prefill(a, PROMPT))
    trained = load_model(TRAINED, kernels="torch")
    with pytest.raises(HandoffError, match="tp_size is 2 on the exporting engine, 1 here"):
        _engine(trained, 0, "lossless").import_request(handoff)
