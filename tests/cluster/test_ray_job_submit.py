"""`ray job submit --working-dir . -- python -m cluster.serve --config ...` against a running
cluster (`ray start --head` on loopback, token auth): the job joins the cluster, serves HTTP,
and stops cleanly with `ray job stop`."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.test_frontend_http import _free_port

pytestmark = [pytest.mark.heavy, pytest.mark.long, pytest.mark.timeout(300)]  # `ray start` + job submit: make long
ROOT = Path(__file__).resolve().parents[2]


def test_ray_job_submit_serves_against_a_running_cluster(tmp_path, tiny_dir):
    bindir = str(Path(sys.executable).parent)
    short = tempfile.mkdtemp(prefix="rj-", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "RAY_TMPDIR": short,
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    gcs, dash, http = _free_port(), _free_port(), _free_port()
    ray = f"{bindir}/ray"
    start = [ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
             "--include-dashboard", "true", "--num-cpus", "2", "--port", str(gcs), "--dashboard-port", str(dash),
             "--disable-usage-stats"]
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=120)
    api = f"http://127.0.0.1:{dash}"
    try:
        config = tmp_path / "c.yaml"
        config.write_text(f"cluster: {{num_replicas: 1}}\nmodel: {{path: {tiny_dir}}}\n"
                          "engine: {kernels: torch, max_model_len: 2048, cache_memory_bytes: 67108864}\n")
        submit = subprocess.run(
            [ray, "job", "submit", "--address", api, "--working-dir", str(ROOT), "--no-wait", "--",
             "python", "-m", "cluster.serve", "--config", str(config), "--port", str(http)],
            env=env, capture_output=True, text=True, timeout=120, check=True)
        job = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
        deadline, url = time.time() + 150, f"http://127.0.0.1:{http}"
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            logs = subprocess.run([ray, "job", "logs", "--address", api, job], env=env, capture_output=True,
                                  text=True).stdout
            pytest.fail(f"the job's server did not come up:\n{logs[-3000:]}")
        body = {"prompt": list(range(100, 400)), "max_tokens": 4, "temperature": 0}
        a = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        b = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        subprocess.run([ray, "job", "stop", "--address", api, job], env=env, capture_output=True, timeout=60)
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(short, ignore_errors=True)
