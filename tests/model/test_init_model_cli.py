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
