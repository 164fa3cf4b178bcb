"""The Grafana dashboard `deploy/grafana/hybridserve.json`: importable (a datasource variable, every
panel with a datasource, PromQL targets, a unique id and a grid position), and every series any
of its expressions or variables queries is exported by a real running server (`hybridserve serve`'s
app on a 1-replica local Ray cluster, after a few requests), with samples, and only under labels
that series carries. Prometheus names the series (`_total` for counters, `_bucket`/`_sum`/
`_count` for histograms), so the check compares them as queried, suffix included."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_prompt

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "hybridserve.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}
TARGET_LABELS = {"instance", "job"}  # added by Prometheus at scrape time, not in /metrics
SERIES_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                   "summary": ("", "_sum", "_count"), "untyped": ("",)}
# queried series that need an event two requests on one replica cannot cause
NEEDS_MORE_THAN_ONE_REPLICA = {"hybridserve_transfers_total": "a transfer needs a second replica holding the prefix"}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def leaf_panels(dashboard: dict) -> list[dict]:
    """Every panel but rows; a collapsed row keeps its panels inside it."""
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out


def expressions(dashboard: dict) -> list[str]:
    """The PromQL of every panel target and every query variable (label_values' metric included)."""
    exprs = [t["expr"] for p in leaf_panels(dashboard) for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip())
            exprs.append(f"sum by ({m.group(2)}) ({m.group(1)})" if m else query)
    return exprs


def parse_promql(expr: str) -> tuple[set[str], set[str]]:
    """(series names, label names) an expression refers to: names outside label matchers, range
    selectors and strings that are neither a function nor a keyword; labels from matchers and
    from by/without/on/ignoring/group_* lists."""
    labels: set[str] = set()

    def matchers(m: re.Match) -> str:
        labels.update(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", m.group(1)))
        return " "

    def grouping(m: re.Match) -> str:
        labels.update(name.strip() for name in m.group(2).split(",") if name.strip())
        return " "

    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{([^}]*)\}", matchers, expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", grouping, expr)
    names = {m.group(1) for m in re.finditer(r"(?<![\w:$.\"])([A-Za-z_:][\w:]*)\s*(\()?", expr)
             if not m.group(2) and m.group(1).lower() not in KEYWORDS}
    return names, labels


def exported_series(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """(every series name the exposition declares, label names per series that has samples)."""
    declared: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        declared.update(family.name + suffix for suffix in SERIES_SUFFIXES[family.type])
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return declared, labels


def problems(exprs: list[str], text: str) -> list[str]:
    """What the expressions query that the `/metrics` text does not export (empty: all of it)."""
    declared, sampled = exported_series(text)
    out = []
    for expr in exprs:
        names, used = parse_promql(expr)
        for name in sorted(names - declared):
            out.append(f"{name} is not exported (in {expr})")
        for name in sorted((names & declared) - sampled.keys() - NEEDS_MORE_THAN_ONE_REPLICA.keys()):
            out.append(f"{name} has no sample after the test's requests (in {expr})")
        known = set().union(*(sampled.get(n, set()) for n in names)) | TARGET_LABELS
        if names <= sampled.keys():  # a series without samples says nothing of its labels
            out += [f"label {label!r} is on none of {sorted(names)} (in {expr})" for label in sorted(used - known)]
    return out


# ---- structure -------------------------------------------------------------------------------------
def test_the_dashboard_is_importable():
    d = load_dashboard()
    assert isinstance(d["schemaVersion"], int) and d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]] + [p["id"] for r in d["panels"] if r["type"] == "row"
                                            for p in r.get("panels", [])]
    assert len(ids) == len(set(ids)), ids
    for panel in d["panels"] + leaf_panels(d):
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    panels = leaf_panels(d)
    assert len(panels) >= 10
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)) and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    # the list: each has a panel
    queried = set().union(*(parse_promql(e)[0] for e in expressions(d)))
    for name in ("hybridserve_time_to_first_token_seconds_bucket", "hybridserve_inter_token_latency_seconds_bucket",
                 "hybridserve_request_latency_seconds_bucket", "hybridserve_prompt_tokens_by_source_total",
                 "hybridserve_prefix_cache_hit_tokens_total", "hybridserve_routing_decisions_by_reason_total",
                 "hybridserve_transfers_total", "hybridserve_transfer_seconds_bucket", "vllm:num_preemptions_total",
                 "hybridserve_num_unfinished_requests", "hybridserve_num_replicas",
                 "hybridserve_prefix_cache_group_hit_tokens_total", "hybridserve_prefix_cache_misses_total"):
        assert name in queried, name


def test_promql_parsing():
    assert parse_promql('histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{instance=~"$x"}'
                        '[$__rate_interval])))') == ({"a_seconds_bucket"}, {"le", "instance"})
    assert parse_promql('sum(rate(vllm:x_total{o="by (z)"}[5m])) / sum(b_total) without (w) offset 1h') == (
        {"vllm:x_total", "b_total"}, {"o", "w"})
    assert parse_promql("max(increase(c_total[1e3s])) > 0.5e-3") == ({"c_total"}, set())


# ---- against a running server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def metrics_text(tiny_dir, tmp_path_factory):
    """`/metrics` of `hybridserve serve`'s app on a 1-replica Ray cluster, after a cold request, its
    resend (a prefix hit) and a streamed request."""
    from cluster.config_loader import load_config
    from cluster.http.local_server import serve_app
    from cluster.serve import build_app

    os.environ["RAY_TMPDIR"] = str(tmp_path_factory.mktemp("ray"))
    config = load_config(None, settings={
        "cluster.backend": "ray", "cluster.num_cpus": 2, "cluster.num_replicas": 1, "model.path": tiny_dir,
        "engine.kernels": "torch", "engine.max_model_len": 512, "engine.cache_memory_bytes": 64 * 2**20})
    server = build_app(config)
    try:
        with serve_app(server.app) as url, httpx.Client(base_url=url, timeout=120) as c:
            body = {"prompt": make_prompt(200, 3), "max_tokens": 4, "ignore_eos": True, "temperature": 0}
            for extra in ({}, {}, {"stream": True}):
                r = c.post("/v1/completions", json={**body, **extra})
                assert r.status_code == 200, r.text
            yield c.get("/metrics").text
    finally:
        server.close()


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_every_queried_series_is_exported_by_a_running_server(metrics_text):
    assert problems(expressions(load_dashboard()), metrics_text) == []
    samples = {s.name: s for f in text_string_to_metric_families(metrics_text) for s in f.samples
               if s.name in {"hybridserve_num_replicas", "hybridserve_replica_slots"}}
    assert samples["hybridserve_num_replicas"].value == 1 and samples["hybridserve_replica_slots"].value == 1
    reasons = {s.labels["reason"]: s.value for f in text_string_to_metric_families(metrics_text) for s in f.samples
               if s.name == "hybridserve_routing_decisions_by_reason_total"}
    assert sum(reasons.values()) == 3, reasons
    # each group's own hit, fed from the engine's lookup report: the cold request hit nothing, its
    # two resends hit every group (the same prompt)
    groups = {s.labels["group"]: s.value for f in text_string_to_metric_families(metrics_text) for s in f.samples
              if s.name == "hybridserve_prefix_cache_group_hit_tokens_total"}
    assert len(groups) >= 2 and all(v > 0 for v in groups.values()), groups
    hit = sum(s.value for f in text_string_to_metric_families(metrics_text) for s in f.samples
              if s.name == "hybridserve_prefix_cache_hit_tokens_total")
    assert 0 < hit <= min(groups.values()), (hit, groups)  # the reconciled hit is at most every group's own


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_a_misspelled_series_or_label_is_reported(metrics_text):
    good = "sum by (source) (rate(hybridserve_prompt_tokens_by_source_total[5m]))"
    assert problems([good], metrics_text) == []
    assert problems([good.replace("by_source", "by_sauce")], metrics_text) == [
        f"hybridserve_prompt_tokens_by_sauce_total is not exported (in {good.replace('by_source', 'by_sauce')})"]
    assert problems([good.replace("_total", "")], metrics_text)  # a counter is queried with its suffix
    assert problems([good.replace("by (source)", "by (group)")], metrics_text) == [
        f"label 'group' is on none of ['hybridserve_prompt_tokens_by_source_total'] "
        f"(in {good.replace('by (source)', 'by (group)')})"]
    # declared, never fed: a panel on it would stay empty
    assert problems(["sum(rate(hybridserve_no_such_thing_total[5m]))"], metrics_text)
