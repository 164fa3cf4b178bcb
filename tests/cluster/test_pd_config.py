"""Prefill/decode roles in the config (`cluster.pd`, `--pd P:D`, `--pd LO-HI:LO-HI`): mixed by
default, per-role autoscaler bounds (the cluster's min/max_replicas their sums), validated on load
with one clear error naming the key."""

import pytest

from cluster.config import ConfigError, PDConfig
from cluster.config_loader import load_config
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
     "cluster.max_replicas (4) must equal cluster.pd.max_prefill + max_decode (1 + 1)"),
    ("cluster:\n  num_replicas: 2\n  min_replicas: 1\n  max_replicas: 3\n  pd:\n    num_prefill: 1\n"
     "    num_decode: 1\n    max_decode: 2\n",
     "cluster.min_replicas (1) must equal cluster.pd.min_prefill + min_decode (1 + 1)"),
    ("cluster:\n  num_replicas: 2\n  pd:\n    num_prefill: 1\n    num_decode: 1\n    min_prefill: 0\n",
     "cluster.pd: need 1 <= min_prefill <= num_prefill <= max_prefill, got min_prefill=0"),
    ("cluster:\n  num_replicas: 3\n  pd:\n    num_prefill: 2\n    num_decode: 1\n    max_prefill: 1\n",
     "cluster.pd: need 1 <= min_prefill <= num_prefill <= max_prefill, got min_prefill=2, num_prefill=2, "
     "max_prefill=1"),
    ("cluster:\n  num_replicas: 3\n  pd:\n    num_prefill: 1\n    num_decode: 2\n    min_decode: 3\n"
     "    max_decode: 4\n",
     "cluster.pd: need 1 <= min_decode <= num_decode <= max_decode, got min_decode=3, num_decode=2"),
    ("cluster:\n  num_replicas: 2\n  pd:\n    num_prefill: 1\n    num_decode: 1\n    max_decode: 0\n",
     "cluster.pd: need 1 <= min_decode <= num_decode <= max_decode, got min_decode=1, num_decode=1, "
     "max_decode=0"),
    ("cluster:\n  pd:\n    max_decode: 3\n", "cluster.pd: max_decode=3 needs num_prefill and num_decode >= 1"),
    ("cluster:\n  pd:\n    num_prefill: 1\n    num_decode: 1\n    max_prefill: two\n",
     "cluster.pd.max_prefill: expected int"),
    ("cluster:\n  pd:\n    num_prefill: 1\n    num_prefil: 1\n", "cluster.pd.num_prefil: unknown key"),
    ("cluster:\n  pd:\n    num_prefill: one\n", "cluster.pd.num_prefill: expected int"),
], ids=["one-side-only", "negative", "count-mismatch", "cluster-max-not-the-roles-sum", "cluster-min-not-the-roles-sum",
        "min-prefill-0", "prefill-max-below-its-count", "decode-min-above-its-count", "decode-max-0",
        "bounds-without-pd", "bound-wrong-type", "typo", "wrong-type"])
def test_bad_pd_is_one_clear_error(tmp_path, yaml_text, message):
    # catches: a half-configured or inconsistent split accepted (a cluster with no decoder, or roles
    # the controller cannot fill), or an error that does not name the key
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        _load(tmp_path, yaml_text)


def test_pd_takes_tensor_parallel_replicas(tmp_path):
    # catches: the old refusal left in (a TP replica's hand-off moves every rank's shard now:
    # tests/cluster/test_tp_ray.py serves one)
    yaml_text = "cluster:\n  num_replicas: 2\n  tp_size: 2\n  pd:\n    num_prefill: 1\n    num_decode: 1\n"
    config = _load(tmp_path, yaml_text)
    assert config.cluster.tp_size == 2 and config.cluster.pd.enabled


def test_inprocess_backend_refuses_pd(tmp_path):
    # catches: pd silently ignored by the one-engine backend
    with pytest.raises(ConfigError, match="cluster.pd needs cluster.backend ray"):
        _load(tmp_path, "cluster:\n  backend: inprocess\n  pd:\n    num_prefill: 1\n    num_decode: 1\n")


def test_role_bounds_left_out_fix_each_role_at_its_count(tmp_path):
    # catches: a bound left out read as 0 or as unbounded (an autoscaler for a fixed split, which
    # would then take over from the restarter), or the cluster's bounds not the roles' sums
    cluster = _load(tmp_path, "cluster:\n  num_replicas: 3\n  pd:\n    num_prefill: 1\n    num_decode: 2\n").cluster
    pd = cluster.pd
    assert (pd.min_prefill, pd.max_prefill, pd.min_decode, pd.max_decode) == (1, 1, 2, 2)
    assert pd.bounds("prefill") == (1, 1) and pd.bounds("decode") == (2, 2)
    assert (cluster.min_replicas, cluster.max_replicas) == (3, 3) and cluster.autoscaler is None


def test_role_bounds_set_the_clusters_bounds_and_the_autoscalers(tmp_path):
    # catches: the bounds not read from YAML, the cluster's min/max not derived from them (or an
    # explicit matching value refused), the autoscaler not configured or not given the roles
    text = ("cluster:\n  num_replicas: 3\n{extra}  pd:\n    num_prefill: 1\n    num_decode: 2\n"
            "    max_prefill: 3\n    min_decode: 1\n    max_decode: 4\n")
    for extra in ("", "  min_replicas: 2\n  max_replicas: 7\n"):
        cluster = _load(tmp_path, text.format(extra=extra)).cluster
        pd = cluster.pd
        assert pd.bounds("prefill") == (1, 3) and pd.bounds("decode") == (1, 4)
        assert (pd.num_prefill, pd.num_decode, pd.min_replicas, pd.max_replicas) == (1, 2, 2, 7)
        assert (cluster.num_replicas, cluster.min_replicas, cluster.max_replicas) == (3, 2, 7)
        scaling = cluster.autoscaler
        assert (scaling.min_replicas, scaling.max_replicas) == (2, 7) and scaling.pd == pd


def test_bounds_of_no_such_role_are_refused():
    # catches: a typo'd role silently answered with some other role's bounds
    with pytest.raises(ValueError, match="no role 'mixed'"):
        PDConfig(1, 1).bounds("mixed")


def test_pd_flag_sets_roles_and_the_replica_count(tmp_path):
    # catches: the flag not mapped (or mapped to the wrong counts), or num_replicas left at the YAML's
    _, settings = parse_serve_args(["--pd", "1:2"])
    config = _load(tmp_path, "cluster:\n  num_replicas: 1\n", settings)
    assert (config.cluster.pd.num_prefill, config.cluster.pd.num_decode, config.cluster.num_replicas) == (1, 2, 3)
    assert config.cluster.autoscaler is None  # fixed counts: the restarter keeps them


@pytest.mark.parametrize(("value", "counts", "bounds"), [
    ("1-3:2-4", (1, 2), (1, 3, 2, 4)),
    ("2:1-2", (2, 1), (2, 2, 1, 2)),
    ("1-1:1", (1, 1), (1, 1, 1, 1)),
])
def test_pd_flag_ranges_set_role_bounds_and_the_clusters(tmp_path, value, counts, bounds):
    # catches: a range read as its max (or LO and HI swapped), a plain count next to a range not fixed,
    # or the cluster's num/min/max_replicas left at the YAML's (its autoscaling 1..4 would be refused)
    _, settings = parse_serve_args(["--pd", value])
    cluster = _load(tmp_path, "cluster:\n  num_replicas: 1\n  min_replicas: 1\n  max_replicas: 4\n",
                    settings).cluster
    pd = cluster.pd
    assert (pd.num_prefill, pd.num_decode) == counts
    assert (*pd.bounds("prefill"), *pd.bounds("decode")) == bounds
    assert (cluster.num_replicas, cluster.min_replicas, cluster.max_replicas) == (
        sum(counts), bounds[0] + bounds[2], bounds[1] + bounds[3])
    assert (cluster.autoscaler is None) == (bounds[0] == bounds[1] and bounds[2] == bounds[3])


def test_pd_flag_range_upside_down_is_refused_by_the_config_naming_the_key(tmp_path):
    # catches: LO-HI with HI < LO accepted (a role the autoscaler could never keep within bounds)
    _, settings = parse_serve_args(["--pd", "3-1:1"])
    with pytest.raises(ConfigError, match="cluster.pd: need 1 <= min_prefill <= num_prefill <= max_prefill, got "
                                          "min_prefill=3, num_prefill=3, max_prefill=1"):
        _load(tmp_path, "cluster: {}\n", settings)


@pytest.mark.parametrize("value", ["1", "1:x", "1:2:3", "-1:1", "1-:1", "1-2-3:1", "a-1:1", "1:2-", "1:-2"])
def test_pd_flag_rejects_malformed_values(value, capsys):
    # catches: a malformed flag reaching the config as something else (e.g. '1' read as 1 prefill, 0 decode)
    with pytest.raises(SystemExit):
        parse_serve_args([f"--pd={value}"])
    assert "--pd takes P:D" in capsys.readouterr().err
