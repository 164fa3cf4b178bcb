"""docker-compose.yml and deploy/kuberay/raycluster.yaml, checked by what they would do. No Docker engine or
Kubernetes here: the files are parsed, each container's shell command is run against stand-ins for `ray` and
`hybridserve` that record their arguments, and the server's arguments go through the real `hybridserve serve`
argument parser and config loader (the cluster it would join, the address it would bind, the device)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.config_loader import load_config
from cluster.serve_args import parse_serve_args

REPO = Path(__file__).resolve().parents[2]
TARGETS = ("cpu", "cuda")  # the Dockerfile's runnable stages (cuda-build only compiles)


def run_command(argv: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> list[list[str]]:
    """Run a container's command with `ray` and `hybridserve` replaced by recorders; their argv, in order."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir(exist_ok=True)
    log.write_text("")
    for name in ("ray", "hybridserve"):
        stub = bin_dir / name
        stub.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        f"open(os.environ['STUB_LOG'], 'a').write(json.dumps(['{name}', *sys.argv[1:]]) + '\\n')\n")
        stub.chmod(0o755)
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log), **(env or {})}
    subprocess.run(argv, env=full_env, check=True, timeout=30, capture_output=True)
    return [json.loads(line) for line in log.read_text().splitlines()]


def serve_config(call: list[str], monkeypatch):
    """The config `hybridserve serve` would run with, from its recorded argv (cwd: the image's WORKDIR)."""
    assert call[:2] == ["hybridserve", "serve"], call
    monkeypatch.chdir(REPO)
    args, settings = parse_serve_args(call[2:])
    return load_config(args.config, args.overrides, settings)


# ---- docker-compose.yml ----

@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def dockerfile_stages() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (REPO / "Dockerfile").read_text(), re.MULTILINE | re.I))


def compose_script(service: dict) -> list[str]:
    """The command as the container gets it: compose's `$$` escape undone. A lone `$` would be interpolated
    by compose on the host, not by the container's shell."""
    argv = service["command"]
    assert not any("$" in part.replace("$$", "") for part in argv), argv
    return [part.replace("$$", "$") for part in argv]


def heads_and_workers(services: dict, profile: str) -> tuple[dict, dict]:
    names = [n for n, s in services.items() if profile in s.get("profiles", [])]
    heads = {n: services[n] for n in names if "ray start --head" in " ".join(services[n]["command"])}
    return heads, {n: services[n] for n in names if n not in heads}


def test_every_service_builds_a_runnable_dockerfile_target(services):
    assert services
    tags: dict[str, str] = {}
    for name, service in services.items():
        build = service["build"]
        assert build["context"] == "." and build.get("dockerfile", "Dockerfile") == "Dockerfile", name
        assert build["target"] in TARGETS and build["target"] in dockerfile_stages(), name
        # one tag per target: two targets under one tag would overwrite each other's image
        assert tags.setdefault(service.get("image", build["target"]), build["target"]) == build["target"], name


def test_every_service_is_in_exactly_one_profile_so_a_laptop_never_starts_a_gpu_service(services):
    for name, service in services.items():
        assert service.get("profiles") in (["cpu"], ["gpu"]), name
        gpus = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        assert (service["profiles"] == ["gpu"]) or not gpus, f"{name} reserves GPUs in the cpu profile"
        assert (service["build"]["target"] == "cuda") == (service["profiles"] == ["gpu"]), name


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_profile_is_one_head_and_one_worker_joining_it_once_healthy(services, profile, tmp_path):
    heads, workers = heads_and_workers(services, profile)
    assert len(heads) == 1 and len(workers) == 1, (list(heads), list(workers))
    (head_name, head), (_, worker) = next(iter(heads.items())), next(iter(workers.items()))
    assert head["healthcheck"]["test"] == ["CMD", "ray", "status"]
    assert worker["depends_on"] == {head_name: {"condition": "service_healthy"}}
    calls = run_command(compose_script(worker), tmp_path)
    assert calls == [["ray", "start", f"--address={head_name}:6379", *calls[0][3:]]]
    assert calls[0][-1] == "--block"  # the worker container lives as long as its raylet
    for service in (head, worker):
        env = service["environment"]
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"].startswith("${RAY_AUTH_TOKEN:?")
    if profile == "gpu":
        (gpu,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_head_starts_ray_then_serves_the_published_port_on_that_cluster(services, profile, tmp_path, monkeypatch):
    (head,) = heads_and_workers(services, profile)[0].values()
    assert "8000:8000" in head["ports"] and "8265:8265" in head["ports"]
    ray, serve = run_command(compose_script(head), tmp_path, {"MODEL": ""})
    assert ray[:3] == ["ray", "start", "--head"] and "--block" not in ray  # returns, so the server can start
    assert {"--port=6379", "--dashboard-host=0.0.0.0"} <= set(ray)
    config = serve_config(serve, monkeypatch)
    assert config.cluster.ray_address == "auto"  # the cluster started above, not an embedded one
    assert config.http.host == "0.0.0.0" and f"{config.http.port}:{config.http.port}" in head["ports"]
    if profile == "cpu":
        # an absolute path in the image (WORKDIR /app): the replicas on the worker resolve it too
        assert config.engine.device == "cpu" and config.model.path.startswith("/app/")
        assert (REPO / config.model.path.removeprefix("/app/") / "config.json").is_file()
    else:
        assert config.engine.device == "cuda" and config.model.path.startswith("/models/")
        assert config.cluster.distributed_backend == "nccl"
        for service in services.values():  # the head reads the tokenizer, the worker's replicas the weights
            if "gpu" in service["profiles"]:
                assert any(re.search(r":(/[^:]*)(:r[ow])?$", v).group(1) == "/models" for v in service["volumes"])
        _, serve = run_command(compose_script(head), tmp_path, {"MODEL": "/models/other"})
        assert serve_config(serve, monkeypatch).model.path == "/models/other"


# ---- deploy/kuberay/raycluster.yaml ----

@pytest.fixture(scope="module")
def kube() -> dict[tuple[str, str], dict]:
    docs = yaml.safe_load_all((REPO / "deploy/kuberay/raycluster.yaml").read_text())
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def the(kube: dict, kind: str) -> list[dict]:
    return [doc for (k, _), doc in kube.items() if k == kind]


def test_kuberay_gcs_fault_tolerance_points_at_the_redis_and_secret_it_defines(kube):
    (cluster,) = the(kube, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    ft = cluster["spec"]["gcsFaultToleranceOptions"]
    host, port = ft["redisAddress"].split(":")
    service = kube[("Service", host)]
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
    redis = next(d for d in the(kube, "Deployment")
                 if d["spec"]["template"]["metadata"]["labels"].items() >= service["spec"]["selector"].items())
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("redis:")
    ref = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] in kube[("Secret", ref["name"])]["stringData"]
    password_env = next(e["name"] for e in container["env"] if e["valueFrom"]["secretKeyRef"] == ref)
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == f"$({password_env})"  # the server requires what Ray sends
    assert args[args.index("--appendonly") + 1] == "yes"


def test_kuberay_sets_no_legacy_ft_option_that_kuberay_rejects_beside_gcs_ft_options(kube):
    (cluster,) = the(kube, "RayCluster")
    assert not {"ray.io/ft-enabled", "ray.io/external-storage-namespace"} & set(cluster["metadata"]["annotations"])
    head = cluster["spec"]["headGroupSpec"]
    assert not {"redis-password", "redis-username"} & set(head["rayStartParams"])
    (container,) = head["template"]["spec"]["containers"]
    env = {e["name"] for e in container.get("env", [])}
    assert not {"RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "REDIS_USERNAME"} & env


def test_kuberay_head_starts_ray_then_serves_and_workers_block(kube, tmp_path, monkeypatch):
    (cluster,) = the(kube, "RayCluster")
    # KubeRay runs the containers' own commands only with this; otherwise the image's CMD would be replaced
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert head["command"][:2] == ["/bin/bash", "-lc"]
    generated = "ray start --head --block --dashboard-host=0.0.0.0 --resources='{\"a\": 1}' --metrics-export-port=8080"
    ray, serve = run_command(["bash", "-c", head["args"][0]], tmp_path, {"KUBERAY_GEN_RAY_START_CMD": generated})
    assert ray == ["ray", "start", "--head", "--dashboard-host=0.0.0.0", '--resources={"a": 1}',
                   "--metrics-export-port=8080"]  # KubeRay's line, quoting kept, --block dropped
    config = serve_config(serve, monkeypatch)
    http_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "http")
    (api,) = [s for s in the(kube, "Service") if s["metadata"]["name"] != cluster["spec"]["gcsFaultToleranceOptions"][
        "redisAddress"].split(":")[0]]
    assert config.cluster.ray_address == "auto" and config.http.host == "0.0.0.0"
    assert config.http.port == http_port == api["spec"]["ports"][0]["targetPort"] == head["readinessProbe"][
        "httpGet"]["port"]
    assert api["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    assert config.engine.device == "cuda" and config.http.api_key is None
    mounts = {m["mountPath"] for m in head["volumeMounts"]}
    assert any(config.model.path.startswith(m + "/") for m in mounts)
    _, serve = run_command(["bash", "-c", head["args"][0]], tmp_path,
                           {"KUBERAY_GEN_RAY_START_CMD": generated, "HYBRIDSERVE_API_KEY": "sk-x"})
    assert serve_config(serve, monkeypatch).http.api_key == "sk-x"
    for group in cluster["spec"]["workerGroupSpecs"]:
        (worker,) = group["template"]["spec"]["containers"]
        calls = run_command(["bash", "-c", worker["args"][0]], tmp_path,
                            {"KUBERAY_GEN_RAY_START_CMD": "ray start --address=h:6379 --block"})
        assert calls == [["ray", "start", "--address=h:6379", "--block"]]
        assert {m["mountPath"] for m in worker["volumeMounts"]} >= mounts  # the replicas load the weights


def test_kuberay_worker_pods_hold_a_whole_replica(kube, tmp_path, monkeypatch):
    (cluster,) = the(kube, "RayCluster")
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    _, serve = run_command(["bash", "-c", head["args"][0]], tmp_path, {"KUBERAY_GEN_RAY_START_CMD": "ray start --head"})
    c = serve_config(serve, monkeypatch).cluster
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"  # replicas go to the workers
    for group in cluster["spec"]["workerGroupSpecs"]:
        (worker,) = group["template"]["spec"]["containers"]
        gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
        assert int(worker["resources"]["requests"]["nvidia.com/gpu"]) == gpus  # Kubernetes: requests == limits
        assert gpus >= c.tp_size * c.num_gpus_per_rank  # a replica's TP ranks are packed on one node
        assert worker["image"] == head["image"]
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
