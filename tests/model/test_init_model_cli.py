"""`hybridserve init-model`: writes a loadable checkpoint; bad input -> one stderr line, exit 2."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from cluster.cli import main as cli_main
from tests.model.helpers import TINY_YAML
from workers.model.init_model import main


def test_cli_dispatch_writes_checkpoint(tmp_path, capsys):
    out = tmp_path / "ck"
    assert (
        cli_main(["init-model", "--config", str(TINY_YAML), "--out", str(out), "--seed", "5", "--no-mtp"])
        == 0
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_h" and cfg["architectures"] == ["NemotronHForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 0
    assert not any(k.startswith("mtp.") for k in load_file(str(out / "model.safetensors")))
    assert "wrote" in capsys.readouterr().out


def test_same_seed_same_weights_and_reference_init(tmp_path):
    for name in ("a", "b"):
        assert main(["--config", str(TINY_YAML), "--out", str(tmp_path / name), "--seed", "1"]) == 0
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("a", "b"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert a["model.layers.0.mixer.A_log"].exp().round().tolist() == list(range(1, 17))
    assert (a["model.layers.0.mixer.D"] == 1).all()
    dt = a["model.layers.0.mixer.dt_bias"].exp().log1p()  # softplus(dt_bias) = initial dt
    assert ((dt >= 1e-3 - 1e-6) & (dt <= 0.1 + 1e-6)).all()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("hidden_size: [1, 2\n", "invalid YAML"),
        ("- just\n- a list\n", "expected a mapping"),
        ("vocab_size: 512\nhybrid_override_pattern: M-\n", "missing required field"),
        ("vocab_size: 512\n", "needs hybrid_override_pattern"),
    ],
)
def test_bad_yaml_exits_2_with_one_line(tmp_path, capsys, text, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_unsupported_layer_and_missing_file_exit_2(tmp_path, capsys):
    moe = tmp_path / "moe.yaml"
    moe.write_text(TINY_YAML.read_text().replace('"M-M*-M-M*-"', '"M-X*"'))
    assert main(["--config", str(moe), "--out", str(tmp_path / "o")]) == 2
    assert "layer 2" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_moe_and_mtp_yaml_writes_a_checkpoint_transformers_agrees_with(tmp_path):
    """An init-model YAML with Nemotron 3-style MoE layers (and an MTP head '*E'): per-expert tensors as
    NVIDIA ships them, loaded by us and by transformers with the same logits."""
    import torch
    import transformers

    from tests.model.helpers import make_tokens, run_chunks
    from workers.model.loader import load_model

    yaml_text = TINY_YAML.read_text().replace('"M-M*-M-M*-"', '"ME*E"').replace('"*-"', '"*E"') + (
        "n_routed_experts: 8\nnum_experts_per_tok: 2\nmoe_intermediate_size: 64\n"
        "moe_shared_expert_intermediate_size: 96\nn_group: 2\ntopk_group: 1\nrouted_scaling_factor: 2.5\n")
    (tmp_path / "moe.yaml").write_text(yaml_text)
    assert main(["--config", str(tmp_path / "moe.yaml"), "--out", str(tmp_path / "o")]) == 0
    ours = load_model(tmp_path / "o", kernels="torch")
    assert ours.mtp is not None and ours.config.moe_layer_ids == (1, 3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o").eval()
    ids = make_tokens(30)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = run_chunks(ours, ours.allocate_caches(4, 16, 1), ids, [30], torch.tensor([0, 1]), 0)
    assert ref.std() > 0.5
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
