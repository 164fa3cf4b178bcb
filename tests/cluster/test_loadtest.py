"""`hybridserve loadtest`: seeded workloads and report math (unit), then real runs against a
`python -m cluster.serve` subprocess on a free loopback port (heavy)."""

import io
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.parquet as pq
import pytest

from cluster.loadtest.__main__ import main
from cluster.loadtest.client import ServerUnreachableError, check_server, run_workload
from cluster.loadtest.compare import make_variants, ratio_rows
from cluster.loadtest.outputs import SCHEMA, write_parquet
from cluster.loadtest.progress import Progress
from cluster.loadtest.prometheus import parse_prometheus
from cluster.loadtest.records import LoadTestResult, RequestRecord
from cluster.loadtest.report import format_table, percentile, ratio, summarize
from cluster.loadtest.server import ServerStartError, free_port, spawn_server
from cluster.loadtest.workloads import RequestSpec, Workload, WorkloadConfig, build_workload

SMALL = dict(num_prompts=3, prompt_len=1024, question_len=64, max_tokens=4, concurrency=2, sessions=2, turns=2,
             tenants=2, questions_per_tenant=3)
SERVER_OVERRIDES = ["engine.max_model_len=4096", "engine.retention='128'"]


def make_record(index, phase, ttft_s, cached=0, prompt=100, status="200", latency_s=None, completion=4):
    return RequestRecord(index, "resend", phase, f"p{index}", 0, prompt, 4, None, status=status, ttft_s=ttft_s,
                         latency_s=latency_s if latency_s is not None else (ttft_s or 0) + 0.3,
                         completion_tokens=completion if status == "200" else None,
                         cached_tokens=cached if status == "200" else None,
                         usage_prompt_tokens=prompt if status == "200" else None)


# ---- workloads ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["resend", "chat", "tenants", "mixed"])
def test_workloads_are_deterministic_under_a_seed(name):
    config = WorkloadConfig(name, salt="s-", **SMALL)
    a, b = build_workload(config), build_workload(config)
    assert a == b
    other = build_workload(config.replace(seed=1))
    assert [s.prompt for s in other.specs] != [s.prompt for s in a.specs]
    for spec in a.specs:
        assert all(3 <= t <= 258 for t in spec.prompt)
        assert all(dep < spec.index for dep in spec.after)


def test_workload_shapes():
    resend = build_workload(WorkloadConfig("resend", salt="", **SMALL)).specs
    assert [s.phase for s in resend] == ["cold"] * 3 + ["warm"] * 3
    assert [s.prompt for s in resend[:3]] == [s.prompt for s in resend[3:]]
    assert all(len(s.prompt) == 1024 and s.cache_salt is None for s in resend)
    assert resend[3].after == (0, 1, 2)

    tenants = build_workload(WorkloadConfig("tenants", salt="x-", **SMALL)).specs
    assert len(tenants) == 2 * 3 and [s.phase for s in tenants[:2]] == ["cold", "cold"]
    t0 = [s for s in tenants if s.group == "t0"]
    assert {s.prompt[:1024] for s in t0} == {t0[0].prompt[:1024]}  # one system prompt
    assert len({s.prompt[1024:] for s in t0}) == 3  # different questions
    assert {s.cache_salt for s in tenants} == {"x-tenant-0", "x-tenant-1"}

    chat = build_workload(WorkloadConfig("chat", salt="", **SMALL)).specs
    assert [(s.group, s.turn, s.extends) for s in chat] == [("s0", 0, None), ("s1", 0, None), ("s0", 1, 0),
                                                          ("s1", 1, 1)]

    mixed = build_workload(WorkloadConfig("mixed", salt="", **SMALL)).specs
    assert len(mixed) == len(resend) + len(tenants) + len(chat)
    assert {s.source for s in mixed[:3]} == {"resend", "chat", "tenants"}
    arrivals = [s.arrival_s for s in mixed]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)  # mixed is open loop by default
    for s in mixed:
        if s.extends is not None:
            assert mixed[s.extends].group == s.group and mixed[s.extends].source == "chat"


def test_workload_config_validates():
    with pytest.raises(ValueError, match="workload must be"):
        WorkloadConfig("nope")
    with pytest.raises(ValueError, match="prompt_len"):
        WorkloadConfig(prompt_len=0)
    with pytest.raises(ValueError, match="rate"):
        WorkloadConfig(rate=-1)


# ---- report math ----------------------------------------------------------------------------

def test_percentile_and_ratio():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(range(1, 101)), 90) == pytest.approx(90.1)
    assert percentile([1.0, 2.0], 100) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert ratio(1.0, 4.0) == 0.25 and ratio(1.0, 0) is None and ratio(None, 1.0) is None


def test_summarize_cold_warm_hits_and_errors():
    records = [make_record(0, "cold", 1.0), make_record(1, "cold", 3.0),
               make_record(2, "warm", 0.1, cached=64), make_record(3, "warm", 0.3, cached=64),
               make_record(4, "warm", None, status="503"), make_record(5, "warm", None, status="timeout")]
    metrics = parse_prometheus("hybridserve_prompt_tokens_total 400.0\n"
                               "hybridserve_prefix_cache_hit_tokens_total 128.0\n")
    s = summarize(LoadTestResult("resend", "v", WorkloadConfig(), records, 2.0, metrics))
    assert (s.cold.ttft_p50_s, s.warm.ttft_p50_s) == (2.0, pytest.approx(0.2))
    assert s.warm_cold_ratio == pytest.approx(0.1)
    assert s.hit_rate == 128 / 400 and s.warm.hit_rate == 128 / 200 and s.cold.hit_rate == 0.0
    assert s.server_hit_rate == 128 / 400
    assert s.errors == {"503": 1, "timeout": 1} and s.num_ok == 4
    assert s.requests_per_s == 2.0 and s.output_tokens_per_s == 8.0
    assert s.tpot_p50_s == pytest.approx(0.1)  # 0.3 s over 3 tokens after the first


def test_prometheus_counters_diff():
    before = parse_prometheus('# HELP x\nhybridserve_requests_total{status="length"} 3.0\n'
                              "hybridserve_prompt_tokens_total 10.0\nhybridserve_ttft_bucket{le=\"1\"} 4.0\n")
    after = parse_prometheus('hybridserve_requests_total{status="length"} 5.0\nhybridserve_prompt_tokens_total 30.0\n'
                             "hybridserve_prefix_cache_hit_tokens_total 15.0\n")
    delta = after - before
    assert delta.get('hybridserve_requests_total{status="length"}') == 2.0
    assert delta.hit_rate == 15 / 20
    assert "hybridserve_ttft_bucket{le=\"1\"}" not in before.samples


def test_table_ratio_rows_and_progress():
    table = format_table(("a", "bb"), [("x", "1"), ("yyy", "22")])
    assert table.splitlines() == ["a    bb", "---  --", "x     1", "yyy  22"]
    base = summarize(LoadTestResult("resend", "base", WorkloadConfig(), [make_record(0, "cold", 1.0),
                                                                         make_record(1, "warm", 0.5)], 1.0, None))
    fast = summarize(LoadTestResult("resend", "fast", WorkloadConfig(), [make_record(0, "cold", 1.0),
                                                                         make_record(1, "warm", 0.25)], 1.0, None))
    rows = ratio_rows([base, fast])
    assert rows[0][2:5] == ("0.500", "1.000", "1.000") and rows[1][2:5] == ("0.250", "1.000", "0.500")
    out = io.StringIO()
    p = Progress("v/resend", 4, stream=out)
    for ok in (True, False, True, True):
        p.update(ok)
    assert "4/4" in out.getvalue().splitlines()[-1] and "1 errors" in out.getvalue().splitlines()[-1]


def test_parquet_schema_round_trip(tmp_path):
    res = LoadTestResult("resend", "v", WorkloadConfig(), [make_record(0, "cold", 1.0),
                                                           make_record(1, "warm", None, status="400")], 1.0, None)
    table = pq.read_table(write_parquet([res], tmp_path / "r.parquet"))
    assert table.schema == SCHEMA and table.num_rows == 2
    assert table.column("status").to_pylist() == ["200", "400"] and table.column("ttft_s").to_pylist()[1] is None


def test_variants_change_one_axis_around_the_config():
    names = [v.name for v in make_variants("configs/local.yaml")]
    assert names == ["hybrid/lossless/latest", "attention_overlap/lossless/latest", "round_robin/lossless/latest",
                     "oracle/lossless/latest", "hybrid/drop/latest", "hybrid/lossless/interval128"]
    oracle = next(v for v in make_variants("configs/local.yaml") if v.name.startswith("oracle"))
    assert "cluster.num_replicas=1" in oracle.overrides and "router.policy=hybrid" in oracle.overrides
    drop = make_variants("configs/local.yaml", ("engine.eagle_mode=drop",), ("eagle",))
    assert [v.name for v in drop] == ["hybrid/drop/latest", "hybrid/lossless/latest"]
    assert drop[1].overrides[0] == "engine.eagle_mode=drop"  # the run's own overrides come first
    assert "engine.eagle_mode=lossless" in drop[1].overrides


def test_unreachable_server_is_a_clear_error(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachableError, match="no server at"):
        check_server(url)
    assert main(["resend", "--url", url, "--out", "/nonexistent-dir/never-written"]) == 2
    assert "no server at" in capsys.readouterr().err
    assert main(["bogus", "--url", url]) == 2


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_spawn_server_reports_a_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  bogus: 1\n")
    with pytest.raises(ServerStartError, match="exited with code 2"):
        with spawn_server(bad, startup_timeout_s=60):
            pass


class _FakeServer(BaseHTTPRequestHandler):
    """Answers by the prompt's first token: 1xx ok, 2xx a 503, 3xx an error chunk mid-stream."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        kind = body["prompt"][0] // 100
        if kind == 2:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "overloaded"}}')
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        chunks = [{"choices": [{"token_ids": [7, 8]}]}]
        if kind == 3:
            chunks.append({"error": {"message": "backend failed: boom", "code": 500}})
        else:
            chunks.append({"choices": [{"token_ids": [9], "finish_reason": "length"}],
                           "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 3,
                                     "prompt_tokens_details": {"cached_tokens": 5, "computed_tokens": 3}}})
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def test_client_counts_http_and_stream_errors_without_raising():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    specs = tuple(RequestSpec(i, "resend", "cold", f"p{i}", 0, (first,) * 8, 4)
                  for i, first in enumerate((150, 250, 350)))
    try:
        res = run_workload(f"http://127.0.0.1:{httpd.server_port}", WorkloadConfig(), show_progress=False,
                           workload=Workload("resend", specs))
    finally:
        httpd.shutdown()
    ok, http_error, broken = res.records
    assert (ok.status, ok.completion_tokens, ok.cached_tokens, ok.output_token_ids) == ("200", 3, 5, [7, 8, 9])
    assert ok.computed_tokens == 3 and summarize(res).num_computed_tokens == 3
    assert ok.ttft_s is not None and ok.latency_s >= ok.ttft_s
    assert (http_error.status, http_error.error) == ("503", '{"error": {"message": "overloaded"}}')
    assert (broken.status, broken.error) == ("stream_error", "backend failed: boom")
    assert res.metrics is None and summarize(res).errors == {"503": 1, "stream_error": 1}


# ---- real runs ------------------------------------------------------------------------------

CONTROL_CPU = min(os.sched_getaffinity(0))  # the server's control plane here, its replicas anywhere


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("loadtest") / "server.log"
    with spawn_server("configs/local.yaml", [*SERVER_OVERRIDES, f"cluster.control_cpus='{CONTROL_CPU}'"],
                      log_path=log) as handle:
        yield handle


def _descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every process below `pid`."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, p in parents.items():
            if p == parent and child not in found:
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f:
                        found[child] = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                frontier.append(child)
    return found


@pytest.mark.heavy
@pytest.mark.timeout(120)
def test_the_control_plane_runs_on_control_cpus_and_replicas_where_the_server_started(server):
    # catches: control_cpus never applied (or applied after Ray started: its daemons would run
    # anywhere), replicas left on the control CPUs they inherit (mixed replicas squeezed onto one
    # core), the controller or cache service outside the control CPUs
    everywhere = set(os.sched_getaffinity(0))
    if everywhere == {CONTROL_CPU}:
        pytest.skip("one CPU: the control plane and the replicas cannot be told apart")
    assert os.sched_getaffinity(server.process.pid) == {CONTROL_CPU}
    procs = _descendants(server.process.pid)
    def affinity(match: str) -> list[set[int]]:
        return [os.sched_getaffinity(p) for p, cmd in procs.items() if match in cmd]
    replicas = [os.sched_getaffinity(p) for p, cmd in procs.items() if "ray::" in cmd and "Replica" in cmd]
    assert len(replicas) >= 1 and all(cpus == everywhere for cpus in replicas), replicas
    for daemon in ("gcs_server", "raylet", "ray::ClusterController", "ray::CacheService"):
        found = affinity(daemon)
        assert found and all(cpus == {CONTROL_CPU} for cpus in found), (daemon, found)


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_resend_and_tenants_against_a_real_server(server, tmp_path, capsys):
    assert main(["resend", "tenants", "--url", server.url, "--no-progress", "--out", str(tmp_path),
                 *(f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items())]) == 0
    printed = capsys.readouterr().out
    assert "warm/cold" in printed and "tenants" in printed
    table = pq.read_table(tmp_path / "records.parquet")
    assert table.schema == SCHEMA and table.num_rows == 6 + 6  # one row per request
    rows = table.to_pylist()
    assert all(r["status"] == "200" and r["completion_tokens"] == 4 for r in rows)
    assert (tmp_path / "loadtest.png").stat().st_size > 10_000 and (tmp_path / "summary.json").is_file()
    for workload in ("resend", "tenants"):
        warm = [r for r in rows if r["workload"] == workload and r["phase"] == "warm"]
        cold = [r for r in rows if r["workload"] == workload and r["phase"] == "cold"]
        assert all(r["cached_tokens"] > 0 for r in warm) and all(r["cached_tokens"] == 0 for r in cold)
        # the work: a cold request computes its whole prompt, a warm one only what it did not hit
        assert all(r["computed_tokens"] == r["num_prompt_tokens"] for r in cold)
        assert all(r["computed_tokens"] == r["num_prompt_tokens"] - r["cached_tokens"] for r in warm)
    # the warm resends' saving is asserted as work (cached prompt tokens), not as wall-clock TTFT
    resend = [r for r in rows if r["workload"] == "resend"]
    assert all(r["ttft_s"] is not None and r["ttft_s"] > 0 for r in resend)


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_chat_and_http_errors_against_a_real_server(server):
    chat = run_workload(server.url, WorkloadConfig("chat", **SMALL), show_progress=False)
    assert [r.status for r in chat.records] == ["200"] * 4
    first, second = chat.records[0], chat.records[2]
    assert second.num_prompt_tokens == first.num_prompt_tokens + 4 + 64  # prompt + response + new message
    assert second.cached_tokens > 0
    too_long = run_workload(server.url, WorkloadConfig("resend", **{**SMALL, "prompt_len": 5000}),
                            show_progress=False)  # over max_model_len: every request is a 400, none raises
    s = summarize(too_long)
    assert s.errors == {"400": 6} and s.num_ok == 0 and s.warm_cold_ratio is None


@pytest.mark.heavy
@pytest.mark.long  # ~15 s, two servers: make long
@pytest.mark.timeout(300)
def test_compare_spawns_one_server_per_variant(tmp_path, capsys):
    # each variant's server on the in-process backend: what is tested is one server per variant, not
    # Ray (two Ray servers made this test 52 s of make test; in process, 12 s)
    overrides = [*SERVER_OVERRIDES[:1], "cluster.backend=inprocess", "cluster.num_replicas=1"]
    args = ["resend", "--compare", "--axes", "eagle", "--no-progress", "--out", str(tmp_path),
            "--num-prompts", "2", "--prompt-len", "768", "--max-tokens", "4", "--concurrency", "2",
            *(x for o in overrides for x in ("--set", o))]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "ratios against the baseline" in printed and "hybrid/drop/latest" in printed
    rows = pq.read_table(tmp_path / "records.parquet").to_pylist()
    assert {r["variant"] for r in rows} == {"hybrid/lossless/latest", "hybrid/drop/latest"} and len(rows) == 8
    assert all(r["status"] == "200" for r in rows)
    assert sorted(p.name for p in tmp_path.glob("server-*.log")) == ["server-hybrid_drop_latest.log",
                                                                      "server-hybrid_lossless_latest.log"]
