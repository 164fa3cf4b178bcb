"""The NemotronH MTP head in vLLM's checkpoint format as our drafter, and tensor parallelism (TP=2 over
gloo) for the MoE and Granite checkpoints built by transformers (tests/model/hf_models.py).

transformers has no MTP forward for NemotronH (it skips mtp.*), so the reference stacks its own
blocks: a NemotronHModel whose layers are mtp_layers_block_type, fed inputs_embeds =
eh_proj(cat(enorm(embed(t_{p+1})), hnorm(h_p))), with norm_f holding final_layernorm -- the structure
vLLM's NemotronHMultiTokenPredictor runs.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.model.helpers import make_table, make_tokens, run_chunks
from tests.model.hf_models import SPECS, build, hf_config
from workers.model.forward_batch import ForwardBatch, SeqChunk
from workers.model.loader import load_model
from workers.tp_worker import launch_local_tp

transformers = pytest.importorskip("transformers")
ATOL = 1e-4


@pytest.fixture(scope="module")
def super_dir(tmp_path_factory):
    return build("nemotron3_super", tmp_path_factory.mktemp("super") / "ckpt", seed=2)


def _mtp_reference(path, ids: torch.Tensor) -> torch.Tensor:
    spec = SPECS["nemotron3_super"]
    full = transformers.AutoModelForCausalLM.from_pretrained(path, config=hf_config("nemotron3_super")).eval()
    cfg = hf_config("nemotron3_super")
    cfg.layers_block_type = list(spec["mtp_layers_block_type"])
    stack = transformers.NemotronHModel(cfg).eval()
    mtp = load_file(str(path / "model-mtp.safetensors"))
    E = spec["n_routed_experts"]
    state = {}
    for name, t in mtp.items():
        name = name.replace("mtp.layers.", "layers.")
        if ".experts." in name:
            continue
        if name == "layers.1.final_layernorm.weight":
            name = "norm_f.weight"
        state[name] = t
    for proj in ("up_proj", "down_proj"):
        state[f"layers.1.mixer.experts.{proj}"] = torch.stack(
            [mtp[f"mtp.layers.1.mixer.experts.{e}.{proj}.weight"] for e in range(E)])
    heads = {k: state.pop(k) for k in list(state) if k.split(".")[-2] in ("enorm", "hnorm", "eh_proj")}
    state["embeddings.weight"] = full.model.embeddings.weight.detach()
    stack.load_state_dict(state, strict=True)
    eps = cfg.layer_norm_epsilon

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    with torch.no_grad():
        h = full.model(ids[None]).last_hidden_state[0]  # [L, H] after norm_f
        e = full.model.embeddings(ids[1:])
        x = torch.cat([rms(e, heads["layers.0.enorm.weight"]), rms(h[:-1], heads["layers.0.hnorm.weight"])], -1)
        x = x @ heads["layers.0.eh_proj.weight"].T
        out = stack(inputs_embeds=x[None]).last_hidden_state[0]
        return full.lm_head(out)


def test_mtp_head_in_vllm_format_matches_reference(super_dir):
    model = load_model(super_dir, kernels="torch")
    assert model.mtp is not None and model.config.mtp_hybrid_override_pattern == "*E"
    ids = make_tokens(30, seed=4, vocab=256)
    caches = model.allocate_caches(4, 16, 1, num_draft_blocks=4)
    hidden = model.forward(ForwardBatch(ids, (SeqChunk(0, 30, torch.tensor([2, 0]), 0),)), caches)
    table = torch.tensor([3, 1])
    first = model.mtp.forward(hidden[:17], ForwardBatch(ids[1:18], (SeqChunk(0, 17, table, 0),)), caches)
    rest = model.mtp.forward(hidden[17:29], ForwardBatch(ids[18:30], (SeqChunk(17, 12, table, 0),)), caches)
    ours = model.compute_logits(torch.cat([first, rest]))
    ref = _mtp_reference(super_dir, ids)
    assert ref.std() > 0.5
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.heavy
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_id", ["nemotron3_nano", "nemotron3_super", "granite_h_tiny", "bamba"])
def test_tp2_matches_tp1_on_moe_granite_and_bamba(tmp_path, model_id):
    """Nemotron 3 Nano: experts split along their width, 2 Mamba groups one per rank; Super: latent MoE
    and its MTP head (an MoE layer too) over the ranks; Granite and Bamba: one Mamba group (as the real
    models) replicated on both ranks, its gated norm reduced across them."""
    torch.set_num_threads(1)
    path = build(model_id, tmp_path / "ckpt", seed=3)
    ids = make_tokens(40, seed=6, vocab=256)
    table = make_table(3, 2, 8)

    def run(model) -> list[torch.Tensor]:
        caches = model.allocate_caches(8, 16, 2, num_draft_blocks=4 if model.mtp else 0)
        out = [run_chunks(model, caches, ids, [25, 1, 14], table, slot=1)]
        if model.mtp is not None:
            hidden = model.forward(ForwardBatch(ids[:20], (SeqChunk(0, 20, torch.tensor([4, 5]), 0),)), caches)
            batch = ForwardBatch(ids[1:21], (SeqChunk(0, 20, torch.tensor([3, 1]), 0),))
            out.append(model.compute_logits(model.mtp.forward(hidden, batch, caches)))
        return out

    ref_model = load_model(path, kernels="torch")
    ref = run(ref_model)
    tp2 = launch_local_tp(str(path), 2)
    try:
        got = run(tp2)
    finally:
        tp2.close()
    c, full = tp2.shard.config, ref_model.config
    assert c.mamba_num_heads * 2 == full.mamba_num_heads and len(got) == (2 if full.num_nextn_predict_layers else 1)
    assert not full.n_routed_experts or c.moe_intermediate_size * 2 == full.moe_intermediate_size
    assert max((g - r).abs().max().item() for g, r in zip(got, ref)) < ATOL
