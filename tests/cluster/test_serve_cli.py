"""`hybridserve serve` as a user runs it: a subprocess on loopback, then HTTP requests."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_serve_subprocess_answers_completions(tmp_path, tiny_dir):
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  path: {tiny_dir}\nengine:\n  kernels: torch\n  max_model_len: 2048\n")
    port = _free_port()
    exe = [str(Path(sys.executable).parent / "hybridserve"), "serve", "--config", str(config), "--port", str(port)]
    proc = subprocess.Popen(exe, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        else:
            pytest.fail("server did not come up")
        body = {"prompt": list(range(100, 400)), "max_tokens": 4, "temperature": 0}
        a = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        b = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_bad_config_exits_2(tmp_path):
    from cluster.serve import main

    bad = tmp_path / "c.yaml"
    bad.write_text("engine:\n  bogus: 1\n")
    assert main(["--config", str(bad)]) == 2
    missing = tmp_path / "m.yaml"
    missing.write_text("model:\n  path: /nonexistent\n  init_config: null\n")
    assert main(["--config", str(missing)]) == 2
