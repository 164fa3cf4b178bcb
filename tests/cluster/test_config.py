import pytest

from cache_service.coordinator import EagleMode
from cluster.config import ConfigError
from cluster.config_loader import load_config


def test_shipped_configs_load():
    local = load_config("configs/local.yaml")
    assert local.cluster.ray_address is None and local.cluster.node_ip_address == "127.0.0.1"
    assert local.http.host == "127.0.0.1" and local.engine.eagle_mode is EagleMode.LOSSLESS
    dgx = load_config("configs/dgx.yaml")
    assert dgx.cluster.tp_size == 4 and dgx.cluster.distributed_backend == "nccl" and dgx.engine.kernels == "cuda"


@pytest.mark.parametrize(
    "text, message",
    [
        ("engine:\n  max_model_lenn: 5\n", "engine.max_model_lenn: unknown key"),
        ("http:\n  port: eighty\n", "http.port: expected int"),
        ("cluster:\n  tp_size: 0\n", "tp_size must be >= 1"),
        ("engine:\n  eagle_mode: sometimes\n", "eagle_mode must be"),
        ("engine:\n  num_spec_tokens: true\n", "expected int"),
        ("router:\n  policy: smart\n", "router.policy must be"),
        ("router:\n  junction_credit: 1.0\n", "router.junction_credit must be in"),
        ("cluster: [1, 2]\n", "cluster: expected a mapping"),
        ("engine: {max_model_len: 8\n", "invalid YAML"),
        ("bogus: 1\n", "bogus: unknown key"),
        ("cluster:\n  cache_service: {shards: 0}\n", "cluster.cache_service: shards must be >= 1"),
        ("cluster:\n  cache_service: {shards: 2, read_replica: false}\n", "cluster.cache_service: shards > 1"),
        ("cluster:\n  index_shards: 2\n", "cluster.index_shards: unknown key"),
    ],
)
def test_bad_configs_give_one_clear_error(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(path)


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/nope.yaml")


def test_router_section_reaches_the_cache_services_router_config(tmp_path):
    from cache_service.router import RouterConfig

    path = tmp_path / "c.yaml"
    path.write_text("router:\n  prefill_cost_per_token: 2.0\n  load_cost_per_queued_token: 3.0\n"
                    "  transfer_cost_per_token: 0.25\n  junction_credit: 0.75\n")
    assert load_config(path).router == RouterConfig(
        prefill_cost_per_token=2.0, load_cost_per_queued_token=3.0, transfer_cost_per_token=0.25, junction_credit=0.75)


def test_cache_service_section_sets_shards_and_read_replica(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster:\n  cache_service:\n    shards: 3\n")
    section = load_config(path).cluster.cache_service
    assert (section.shards, section.read_replica) == (3, True)
    assert load_config(None, ["cluster.cache_service.read_replica=false"]).cluster.cache_service.read_replica is False
    assert load_config(None).cluster.cache_service.shards == 1
