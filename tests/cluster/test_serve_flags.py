"""`hybridserve serve` flags as in `vllm serve`: they override the YAML, `--version`, a busy port
or a missing model fail before anything starts, and `... | head` ends without a traceback."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import serve
from cluster.config_loader import load_config
from cluster.serve_args import check_port_free, parse_serve_args

ROOT = Path(__file__).resolve().parents[2]


def test_flags_override_the_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("http:\n  port: 9000\n  host: 127.0.0.1\nengine:\n  max_model_len: 4096\n  num_spec_tokens: 3\n"
                      "model:\n  path: somewhere\n  init_config: configs/models/tiny-nemotron-h.yaml\n")
    args, settings = parse_serve_args([
        "my/model", "--config", str(config), "--host", "0.0.0.0", "--port", "8123", "--served-model-name", "123",
        "--tensor-parallel-size", "2", "--api-key", "true", "--dtype", "half", "--max-model-len", "2048",
        "--num-speculative-tokens", "0", "--no-enable-prefix-caching", "--chat-template", "t.jinja",
        "--generation-config", "vllm", "--set", "router.policy=round_robin", "--set", "http.port=7000"])
    c = load_config(args.config, args.overrides, settings)
    assert (c.http.host, c.http.port, c.http.api_key) == ("0.0.0.0", 8123, "true")  # flags beat --set and YAML
    assert (c.model.path, c.model.init_config, c.model.served_model_name) == ("my/model", None, "123")
    assert (c.model.dtype, c.model.chat_template, c.cluster.tp_size) == ("float16", "t.jinja", 2)
    assert c.model.generation_config == "vllm"
    assert (c.engine.max_model_len, c.engine.num_spec_tokens, c.engine.enable_prefix_caching) == (2048, 0, False)
    assert c.router.policy == "round_robin"
    # flags left out keep the YAML's values
    args, settings = parse_serve_args(["--config", str(config), "--enable-prefix-caching"])
    c = load_config(args.config, args.overrides, settings)
    assert (c.http.port, c.engine.max_model_len, c.model.path, c.engine.enable_prefix_caching) == (
        9000, 4096, "somewhere", True)
    assert c.model.generation_config == "auto"
    with pytest.raises(SystemExit):
        parse_serve_args(["a", "--model", "b"])


def test_version(capsys):
    from cluster.cli import main

    assert main(["--version"]) == 0
    with pytest.raises(SystemExit) as exc:
        serve.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.count("hybridserve 0.1.0") == 2


def test_missing_model_is_named_and_nothing_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(serve, "build_backend", lambda *a: pytest.fail("the backend must not start"))
    assert serve.main([str(tmp_path / "no-such-model"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "does not exist" in err and "Traceback" not in err


def test_busy_port_fails_before_the_cluster_starts(tiny_dir, capsys, monkeypatch):
    monkeypatch.setattr(serve, "build_app", lambda *a: pytest.fail("nothing may start on a busy port"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert serve.main([tiny_dir, "--port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err
    check_port_free("127.0.0.1", port)  # free again once closed


def test_explain_into_a_closed_pipe_has_no_traceback():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write, as after `| head` exits
    try:
        p = subprocess.run([sys.executable, "-m", "cluster.cli", "explain", "--group", "full:16", "--group",
                            "mamba:64", "--prompt-len", "8901"], stdout=write_end, stderr=subprocess.PIPE,
                           text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    finally:
        os.close(write_end)
    assert p.returncode == 141 and p.stderr == ""


def test_cuda_graphs_flag_reaches_the_engine_config():
    args, settings = parse_serve_args(["--cuda-graphs", "on", "--set", "engine.device=cuda"])
    assert load_config(args.config, args.overrides, settings).engine.cuda_graphs == "on"
    args, settings = parse_serve_args([])
    assert load_config(args.config, args.overrides, settings).engine.cuda_graphs == "off"
    with pytest.raises(SystemExit):
        parse_serve_args(["--cuda-graphs", "maybe"])


def test_host_cache_gib_flag_reaches_the_engine_config(capsys):
    args, settings = parse_serve_args(["--host-cache-gib", "1.5"])
    assert load_config(args.config, args.overrides, settings).engine.host_cache_bytes == 3 * 2**29
    args, settings = parse_serve_args([])
    assert load_config(args.config, args.overrides, settings).engine.host_cache_bytes == 0
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            parse_serve_args(["--host-cache-gib", bad])
        assert "--host-cache-gib must be >= 0" in capsys.readouterr().err
