"""Prefill/decode roles in the config (`cluster.pd`, `--pd P:D`): mixed by default, validated on
load with one clear error naming the key."""

import pytest

from cluster.config import ConfigError, load_config
from cluster.serve_args import parse_serve_args


def _load(tmp_path, yaml_text: str, settings=None):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    return load_config(path, settings=settings)


def test_default_is_mixed(tmp_path):
    # catches: a default that turns disaggregation on (every existing deployment would change)
    pd = _load(tmp_path, "cluster:\n  num_replicas: 2\n").cluster.pd
    assert not pd.enabled and (pd.num_prefill, pd.num_decode) == (0, 0)


def test_pd_roles_load(tmp_path):
    # catches: the section not read from YAML (an unknown key) or its counts swapped
    pd = _load(tmp_path, "cluster:\n  num_replicas: 3\n  pd:\n    num_prefill: 1\n    num_decode: 2\n").cluster.pd
    assert pd.enabled and (pd.num_prefill, pd.num_decode) == (1, 2)


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("cluster:\n  num_replicas: 2\n  pd:\n    num_prefill: 1\n    num_decode: 0\n",
     "cluster.pd: need both num_prefill and num_decode >= 1"),
    ("cluster:\n  num_replicas: 2\n  pd:\n    num_prefill: -1\n    num_decode: 3\n",
     "cluster.pd: replica counts must be >= 0"),
    ("cluster:\n  num_replicas: 3\n  pd:\n    num_prefill: 1\n    num_decode: 1\n",
     "num_prefill + num_decode (1 + 1) must equal cluster.num_replicas (3)"),
    ("cluster:\n  num_replicas: 2\n  max_replicas: 4\n  pd:\n    num_prefill: 1\n    num_decode: 1\n",
     "cluster.pd: a fixed replica count only"),
    ("cluster:\n  num_replicas: 2\n  tp_size: 2\n  pd:\n    num_prefill: 1\n    num_decode: 1\n",
     "cluster.pd: tp_size 1 only"),
    ("cluster:\n  pd:\n    num_prefill: 1\n    num_prefil: 1\n", "cluster.pd.num_prefil: unknown key"),
    ("cluster:\n  pd:\n    num_prefill: one\n", "cluster.pd.num_prefill: expected int"),
], ids=["one-side-only", "negative", "count-mismatch", "autoscaled", "tensor-parallel", "typo", "wrong-type"])
def test_bad_pd_is_one_clear_error(tmp_path, yaml_text, message):
    # catches: a half-configured or inconsistent split accepted (a cluster with no decoder, or roles
    # the controller cannot fill), or an error that does not name the key
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        _load(tmp_path, yaml_text)


def test_inprocess_backend_refuses_pd(tmp_path):
    # catches: pd silently ignored by the one-engine backend
    with pytest.raises(ConfigError, match="cluster.pd needs cluster.backend ray"):
        _load(tmp_path, "cluster:\n  backend: inprocess\n  pd:\n    num_prefill: 1\n    num_decode: 1\n")


def test_pd_flag_sets_roles_and_the_replica_count(tmp_path):
    # catches: the flag not mapped (or mapped to the wrong counts), or num_replicas left at the YAML's
    _, settings = parse_serve_args(["--pd", "1:2"])
    config = _load(tmp_path, "cluster:\n  num_replicas: 1\n", settings)
    assert (config.cluster.pd.num_prefill, config.cluster.pd.num_decode, config.cluster.num_replicas) == (1, 2, 3)


@pytest.mark.parametrize("value", ["1", "1:x", "1:2:3", "-1:1"])
def test_pd_flag_rejects_malformed_values(value, capsys):
    # catches: a malformed flag reaching the config as something else (e.g. '1' read as 1 prefill, 0 decode)
    with pytest.raises(SystemExit):
        parse_serve_args([f"--pd={value}"])
    assert "--pd takes P:D" in capsys.readouterr().err
