"""config_mapping / loader edge cases: every config field accounted for (an unknown or math-changing one
is an error naming it), NemotronH format variants, tie_word_embeddings, list eos ids, placement, model.path."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.helpers import make_tokens, run_chunks
from tests.model.hf_models import NEMOTRON3_NANO_PUBLISHED, NEMOTRON3_SUPER_PUBLISHED, SPECS, build, load_hf
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.config import HybridModelConfig
from workers.model.errors import ConfigError, MissingTensorError, TensorShapeError
from workers.model.loader import load_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    return build("nemotron_h_t5", tmp_path_factory.mktemp("t5") / "ckpt", seed=4)


@pytest.fixture
def t5_copy(t5_dir, tmp_path):
    return shutil.copytree(t5_dir, tmp_path / "ckpt")


def _raw(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _write(path, raw: dict) -> None:
    (path / "config.json").write_text(json.dumps(raw))


def _logits(model, n=20):
    ids = make_tokens(n, seed=2, vocab=256)
    return run_chunks(model, model.allocate_caches(2, 16, 1), ids, [n], torch.tensor([1, 0]), 0)


def test_transformers5_config_round_trip_fields(t5_dir):
    raw = _raw(t5_dir)
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"} and "layers_block_type" in raw
    cfg = HybridModelConfig.from_dict(raw)
    assert cfg.hybrid_override_pattern == "M*M-M-" and cfg.dt_limit == (0.001, math.inf)
    assert HybridModelConfig.from_dict({**raw, "rope_theta": 1e4}).rope_theta is None  # ignored, as transformers


@pytest.mark.parametrize(("change", "needle"), [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"my_new_feature": 1}, "my_new_feature"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"head_dim": 16, "attention_head_dim": 32}, "attention_head_dim"),
    ({"n_shared_experts": 2, "layers_block_type": ["moe"], "n_routed_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 8, "moe_shared_expert_intermediate_size": 8}, "n_shared_experts"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id"),
    ({"mlp_gated": True}, "mlp_gated"),  # our own field, not a NemotronH one: not settable from config.json
    ({"embedding_multiplier": 12.0}, "embedding_multiplier"),
])
def test_unknown_or_math_changing_fields_are_named(t5_dir, change, needle):
    raw = {**_raw(t5_dir), **change}
    with pytest.raises(ConfigError, match=needle):
        HybridModelConfig.from_dict(raw)


@pytest.mark.parametrize(("change", "needle"), [
    ({"attention_bias": True}, "attention_bias"),
    ({"position_embedding_type": "rope", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mamba_d_head": 7}, "mamba_d_head"),
    ({"layer_types": ["mamba", "moe", "mamba", "mamba"]}, "layer_types"),
    ({"mlp_bias": True}, "mlp_bias"),  # transformers' Granite MLPs have no bias whatever this says
    ({"n_group": 4}, "n_group"),
])
def test_granite_fields_that_change_the_math_are_refused(change, needle):
    raw = {k: v for k, v in SPECS["granite_h_tiny"].items()}
    raw.update(change)
    with pytest.raises(ConfigError, match=needle):
        HybridModelConfig.from_dict(raw)


def test_granite_and_bamba_map_onto_two_blocks_per_layer():
    g = HybridModelConfig.from_dict(dict(SPECS["granite_h_tiny"]))
    assert g.hybrid_override_pattern == "MEME*EME" and g.moe_router == "softmax_topk" and g.mlp_gated
    assert (g.intermediate_size, g.moe_intermediate_size, g.embedding_multiplier) == (48, 32, 12.0)
    assert g.rope_theta is None and g.attention_scale == 0.0078125 and g.dt_limit == (0.0, math.inf)
    b = HybridModelConfig.from_dict(dict(SPECS["bamba"]))
    assert b.hybrid_override_pattern == "M-M-*-M-" and b.rotary_dim == 8 and b.rope_theta == 10000.0


def test_tie_word_embeddings_nemotron_uses_a_stored_lm_head_like_transformers(t5_copy):
    raw = _raw(t5_copy)
    _write(t5_copy, {**raw, "tie_word_embeddings": True})
    ours = load_model(t5_copy, kernels="torch")
    assert not ours.tied
    with torch.no_grad():
        ref = load_hf("nemotron_h_t5", t5_copy)(make_tokens(20, seed=2, vocab=256)[None]).logits[0]
    torch.testing.assert_close(_logits(ours), ref, atol=1e-4, rtol=0)


def test_tie_word_embeddings_without_stored_head_uses_the_embeddings(t5_copy):
    shard = next(t5_copy.glob("model*.safetensors"))
    tensors = load_file(str(shard))
    emb = tensors["backbone.embeddings.weight"]
    save_file({**tensors, "lm_head.weight": emb.clone()}, str(shard))
    untied = load_model(t5_copy, kernels="torch")
    tensors.pop("lm_head.weight")
    save_file(tensors, str(shard))
    with pytest.raises(MissingTensorError, match="lm_head.weight"):
        load_model(t5_copy, kernels="torch")
    _write(t5_copy, {**_raw(t5_copy), "tie_word_embeddings": True})
    tied = load_model(t5_copy, kernels="torch")
    assert tied.tied and tied.lm_head.weight is tied.model.embeddings.weight
    assert torch.equal(_logits(tied), _logits(untied))


def test_list_eos_ids_stop_generation(t5_copy):
    model = load_model(t5_copy, kernels="torch")
    engine = LLMEngine(model, EngineConfig(kernels="torch", max_model_len=128, cache_memory_bytes=4 * 2**20,
                                           num_spec_tokens=0))
    prompt = make_tokens(10, seed=8, vocab=256).tolist()
    (free,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    stop_at = next(i for i, t in enumerate(free.token_ids) if t not in free.token_ids[:i] and t != 2 and i >= 2)
    _write(t5_copy, {**_raw(t5_copy), "eos_token_id": [2, free.token_ids[stop_at]]})
    model = load_model(t5_copy, kernels="torch")
    assert model.config.eos_token_ids == {2, free.token_ids[stop_at]}
    engine = LLMEngine(model, EngineConfig(kernels="torch", max_model_len=128, cache_memory_bytes=4 * 2**20,
                                           num_spec_tokens=0))
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert list(out.token_ids) == list(free.token_ids[: stop_at + 1]) and out.finish_reason == "stop"


def test_missing_expert_and_misshapen_fused_tensor_are_named(tmp_path):
    path = build("nemotron3_nano", tmp_path / "nano", seed=5)
    shard = next(path.glob("model*.safetensors"))
    tensors = load_file(str(shard))
    tensors.pop("backbone.layers.1.mixer.experts.5.up_proj.weight")
    save_file(tensors, str(shard))
    with pytest.raises(MissingTensorError, match=r"layers\.1\.mixer\.experts\.up_proj\[5\]"):
        load_model(path, kernels="torch")
    gpath = build("granite_h_tiny", tmp_path / "granite", seed=5)
    shard = next(gpath.glob("model*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.layers.0.block_sparse_moe.output_linear.weight"] = torch.zeros(8, 64, 31)
    save_file(tensors, str(shard))
    with pytest.raises(TensorShapeError, match=r"output_linear.*\(8, 64, 31\)"):
        load_model(gpath, kernels="torch")


def test_multi_shard_dtype_and_device_placement(t5_dir, tmp_path):
    """Shards split across files load like one; every weight and cache pool follows dtype and device
    (the device is a parameter: `meta` stands in for a second device on this CPU-only machine)."""
    tensors = {}
    for f in t5_dir.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(t5_dir / "config.json", out / "config.json")
    names = sorted(tensors)
    for i in range(3):
        save_file({n: tensors[n] for n in names[i::3]}, str(out / f"model-0000{i + 1}-of-00003.safetensors"))
    sharded, single = load_model(out, kernels="torch"), load_model(t5_dir, kernels="torch")
    assert torch.equal(_logits(sharded), _logits(single))
    for device in ("cpu", "meta"):
        m = load_model(out, dtype=torch.float16, device=device, kernels="torch")
        assert {(p.device.type, p.dtype) for p in m.parameters()} == {(device, torch.float16)}
        caches = m.allocate_caches(2, 16, 1)
        pools = [t for kv in caches.kv.values() for t in kv] + list(caches.conv.values()) + list(caches.ssm.values())
        assert {t.device.type for t in pools} == {device}


def test_set_model_path_that_does_not_exist_is_an_error_naming_it(tmp_path):
    from cluster.config import ConfigError as ServeConfigError
    from cluster.config import ModelSection, ServeConfig
    from cluster.serve import resolve_model_dir

    typo = ModelSection(path=str(tmp_path / "typo"), init_config="configs/models/tiny-nemotron-h.yaml")
    cfg = ServeConfig(model=typo)
    with pytest.raises(ServeConfigError, match=r"model\.path .*typo.* does not exist"):
        resolve_model_dir(cfg)


def test_mamba_ssm_cache_dtype_sets_the_state_dtype(t5_copy):
    _write(t5_copy, {**_raw(t5_copy), "mamba_ssm_cache_dtype": "bfloat16"})
    model = load_model(t5_copy, kernels="torch")
    caches = model.allocate_caches(2, 16, 1)
    assert {t.dtype for t in caches.ssm.values()} == {torch.bfloat16}
    assert {t.dtype for t in caches.conv.values()} == {torch.float32}  # conv state follows the model dtype
    assert model.state_bytes_per_slot() == caches.state_bytes_per_slot()
    with torch.no_grad():
        ref = load_hf("nemotron_h_t5", t5_copy)(make_tokens(20, seed=2, vocab=256)[None]).logits[0]
    ids = make_tokens(20, seed=2, vocab=256)
    got = run_chunks(model, caches, ids, [12] + [1] * 8, torch.tensor([1, 0]), 0)  # decode from bf16 state
    assert 0 < (got - ref).abs().max() < 0.1


def test_older_granite_and_bamba_config_fields():
    """Fields of the published config.json files that transformers 5 no longer writes: granite's
    init_method / normalization_function / top-level rope_theta, Bamba's attn_rotary_emb."""
    granite = {**SPECS["granite_h_tiny"], "init_method": "mup", "normalization_function": "rmsnorm",
               "rope_theta": 10000.0, "rope_scaling": None}
    assert HybridModelConfig.from_dict(granite).rope_theta is None  # position_embedding_type nope
    with pytest.raises(ConfigError, match="normalization_function"):
        HybridModelConfig.from_dict({**granite, "normalization_function": "layernorm"})
    roped = {**granite, "position_embedding_type": "rope"}
    roped.pop("rope_parameters", None)
    assert HybridModelConfig.from_dict(roped).rope_theta == 10000.0
    bamba = {k: v for k, v in SPECS["bamba"].items() if k != "rope_parameters"}
    cfg = HybridModelConfig.from_dict({**bamba, "rope_theta": 5e5, "attn_rotary_emb": 8})
    assert (cfg.rope_theta, cfg.rotary_dim) == (5e5, 8)
    with pytest.raises(ConfigError, match="attn_rotary_emb"):
        HybridModelConfig.from_dict({**bamba, "attn_rotary_emb": 16})
    with pytest.raises(ConfigError, match="rope_scaling"):
        HybridModelConfig.from_dict({**bamba, "rope_scaling": {"type": "linear", "factor": 2.0}})


@pytest.mark.parametrize("model_id", ["nemotron3_nano", "nemotron3_super"])
def test_published_nemotron3_field_set_loads_and_unknown_fields_still_refused(tmp_path, model_id):
    """The published Nemotron 3 files carry norm_eps and partial_rotary_factor (and rope_theta), which
    neither transformers nor vLLM reads for NemotronH: they load (logits vs transformers in
    test_hf_matrix), while a field nobody knows is still refused by name."""
    path = build(model_id, tmp_path / model_id, seed=5)
    raw = _raw(path)
    published = NEMOTRON3_NANO_PUBLISHED if model_id == "nemotron3_nano" else NEMOTRON3_SUPER_PUBLISHED
    assert set(raw) == set(published)
    assert raw["norm_eps"] == 1e-05 and raw["partial_rotary_factor"] == 1.0 and raw["rope_theta"] == 10000
    model = load_model(path, kernels="torch")
    assert model.config.layer_norm_epsilon == raw["layer_norm_epsilon"] and model.config.rope_theta is None
    # ignored means ignored: other values change nothing (a loader reading norm_eps or rotating would)
    _write(path, {**raw, "norm_eps": 0.25, "partial_rotary_factor": 0.5, "rope_theta": 500})
    assert torch.equal(_logits(load_model(path, kernels="torch")), _logits(model))
    _write(path, {**raw, "norm_epsilon": 1e-6})
    with pytest.raises(ConfigError, match=r"unknown nemotron_h config field\(s\) norm_epsilon"):
        load_model(path, kernels="torch")
