"""MTP head: loading, shapes, equality with a dense no-cache reference, draft KV paging across chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.model.helpers import make_table, make_tokens, run_chunks
from workers.model.forward_batch import ForwardBatch, SeqChunk
from workers.model.loader import load_model

ATOL = 1e-4


def _target_hidden(model, ids):
    caches = model.allocate_caches(16, 16, 1)
    batch = ForwardBatch(ids, (SeqChunk(0, len(ids), make_table(-(-len(ids) // 16), 0, 16), 0),))
    return model.forward(batch, caches)


def _dense_mtp(model, prev_hidden, next_ids):
    """Reference MTP math without caches: one causal pass over the whole sequence."""
    mtp, cfg = model.mtp, model.config
    first = mtp.layers[0]
    e = model.model.embeddings(next_ids)
    x = first.eh_proj(torch.cat([first.enorm(e), first.hnorm(prev_hidden)], -1))
    for layer in mtp.layers:
        y = layer.norm(x)
        if hasattr(layer.mixer, "q_proj"):
            T, H, Hkv, hd = len(y), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            q = layer.mixer.q_proj(y).view(T, H, hd).transpose(0, 1)
            k = layer.mixer.k_proj(y).view(T, Hkv, hd).repeat_interleave(H // Hkv, 1).transpose(0, 1)
            v = layer.mixer.v_proj(y).view(T, Hkv, hd).repeat_interleave(H // Hkv, 1).transpose(0, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, H * hd)
            x = x + layer.mixer.o_proj(a)
        else:
            x = x + layer.mixer(y)
    return mtp.layers[-1].final_layernorm(x)


@pytest.fixture(scope="module")
def seq(model):
    ids = make_tokens(61, seed=21)
    with torch.no_grad():
        hidden = _target_hidden(model, ids[:60])  # h_p for p < 60
        ref = _dense_mtp(model, hidden, ids[1:61])
    return ids, hidden, ref


def test_mtp_loads_with_expected_names_and_shapes(model, tiny_dir, seq):
    assert model.mtp is not None
    names = {n for n in load_file(str(tiny_dir / "model.safetensors")) if n.startswith("mtp.")}
    assert names == {"mtp." + n for n, _ in model.mtp.named_parameters()}
    assert {
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.hnorm.weight",
        "mtp.layers.1.final_layernorm.weight",
    } <= names
    assert not any("embeddings" in n or "lm_head" in n for n in names)  # shared with the target
    ids, hidden, _ = seq
    caches = model.allocate_caches(4, 16, 1, num_draft_blocks=6, draft_block_size=16)
    assert set(caches.draft_kv) == {0}
    out = model.mtp.forward(
        hidden, ForwardBatch(ids[1:61], (SeqChunk(0, 60, make_table(4, 1, 6), 0),)), caches
    )
    assert out.shape == (60, model.config.hidden_size)
    assert model.compute_logits(out).shape == (60, model.config.vocab_size)


@pytest.mark.parametrize(
    ("splits", "block_size"), [([60], 16), ([17, 1, 30, 12], 16), ([1, 1, 58], 4), ([8, 8, 44], 8)]
)
def test_mtp_paged_matches_dense_reference(model, seq, splits, block_size):
    ids, hidden, ref = seq
    pool = -(-60 // block_size) + 4
    caches = model.allocate_caches(4, 16, 1, num_draft_blocks=pool, draft_block_size=block_size)
    table = make_table(pool - 4, 3, pool)
    outs, pos = [], 0
    for n in splits:
        chunk = SeqChunk(pos, n, table, state_slot=123)  # state_slot is ignored by the MTP head
        outs.append(
            model.mtp.forward(
                hidden[pos : pos + n], ForwardBatch(ids[pos + 1 : pos + 1 + n], (chunk,)), caches
            )
        )
        pos += n
    torch.testing.assert_close(torch.cat(outs), ref, atol=ATOL, rtol=0)


def test_mtp_batched_sequences(model, seq):
    ids, hidden, ref = seq
    other = make_tokens(11, seed=3)
    with torch.no_grad():
        h2 = _target_hidden(model, other[:10])
        ref2 = _dense_mtp(model, h2, other[1:])
    caches = model.allocate_caches(4, 16, 1, num_draft_blocks=10)
    perm = make_table(10, 4, 10)
    run = model.mtp.forward(hidden[:40], ForwardBatch(ids[1:41], (SeqChunk(0, 40, perm[:4], 0),)), caches)
    batch = ForwardBatch(
        torch.cat([ids[41:61], other[1:]]), (SeqChunk(40, 20, perm[:4], 0), SeqChunk(0, 10, perm[4:5], 0))
    )
    out = model.mtp.forward(torch.cat([hidden[40:], h2]), batch, caches)
    torch.testing.assert_close(torch.cat([run, out[:20]]), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(out[20:], ref2, atol=ATOL, rtol=0)


def test_mtp_without_draft_pool_is_a_clear_error(model, seq):
    ids, hidden, _ = seq
    caches = model.allocate_caches(4, 16, 1)
    with pytest.raises(Exception, match="block_table|draft"):
        model.mtp.forward(hidden[:3], ForwardBatch(ids[1:4], (SeqChunk(0, 3, torch.tensor([0]), 0),)), caches)


def test_checkpoint_without_mtp_loads_with_mtp_none(tiny_nomtp_dir):
    m = load_model(tiny_nomtp_dir, kernels="torch")
    assert m.mtp is None and m.config.num_nextn_predict_layers == 0
    assert m.draft_kv_bytes_per_block(16) == 0
    caches = m.allocate_caches(4, 16, 2, num_draft_blocks=4)
    assert caches.draft_kv == {}
    ids = make_tokens(5)
    assert run_chunks(m, caches, ids, [5], torch.tensor([1]), 0).shape == (5, 512)


def test_config_with_mtp_but_no_mtp_tensors_gives_mtp_none(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    tensors = {
        k: v for k, v in load_file(str(tiny_dir / "model.safetensors")).items() if not k.startswith("mtp.")
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert load_model(tmp_path, kernels="torch").mtp is None


def test_transformers_loads_checkpoint_with_mtp_tensors(tiny_dir):
    transformers = pytest.importorskip("transformers")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
