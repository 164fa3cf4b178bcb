"""No Docker engine or cloud here: the deployment files are validated by parsing them."""

import yaml


def test_docker_compose_has_a_head_and_gpu_workers_running_ray_start():
    doc = yaml.safe_load(open("docker-compose.yml"))
    services = doc["services"]
    head, worker = services["ray-head"], services["ray-gpu-worker"]
    assert "ray start --head" in head["command"] and "--block" in head["command"]
    assert "ray start --address=ray-head:6379" in worker["command"]
    assert worker["depends_on"]["ray-head"]["condition"] == "service_healthy"
    gpu = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and gpu["driver"] == "nvidia"
    assert head["environment"]["RAY_AUTH_MODE"] == worker["environment"]["RAY_AUTH_MODE"] == "token"
    assert "8000:8000" in head["ports"]


def test_cluster_launcher_config_has_head_and_autoscaled_gpu_workers():
    doc = yaml.safe_load(open("configs/cluster.yaml"))
    types = doc["available_node_types"]
    assert doc["head_node_type"] == "head" and "head" in types
    gpu = types["gpu_worker"]
    assert gpu["resources"]["GPU"] >= 1
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"] <= doc["max_workers"]
    assert any("ray start --head" in c for c in doc["head_start_ray_commands"])
    assert any("ray start --address" in c for c in doc["worker_start_ray_commands"])
