"""No cloud here: the Ray cluster-launcher config is validated by parsing it (docker-compose.yml and the
KubeRay example: tests/cluster/test_deploy_cluster.py)."""

import yaml


def test_cluster_launcher_config_has_head_and_autoscaled_gpu_workers():
    doc = yaml.safe_load(open("configs/cluster.yaml"))
    types = doc["available_node_types"]
    assert doc["head_node_type"] == "head" and "head" in types
    gpu = types["gpu_worker"]
    assert gpu["resources"]["GPU"] >= 1
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"] <= doc["max_workers"]
    assert any("ray start --head" in c for c in doc["head_start_ray_commands"])
    assert any("ray start --address" in c for c in doc["worker_start_ray_commands"])
