"""One config tree of frozen dataclasses, loaded from YAML and validated on load.

    ServeConfig
      cluster  ClusterConfig   Ray address (None = embedded local cluster), bind addresses, replicas, TP
        restart  ReplicaRestartConfig (cluster.control.replica_restarts) a fixed count's crash-loop backoff
      http     HttpConfig      front-end bind address, port, optional API key
      model    ModelSection    checkpoint dir, dtype, kernels
      engine   EngineConfig    (workers.engine.config) scheduler, pools, speculation, retention
      router   RouterSection   routing policy and cost weights

Unknown keys, wrong types and bad values are one clear `ConfigError` naming the key path.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cluster.control.replica_restarts import ReplicaRestartConfig
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineConfigError


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ClusterConfig:
    backend: str = "ray"  # ray: replicas as Ray actors + cache service; inprocess: one engine, no Ray
    name: str = "hybridserve"  # the cluster's controller is "<name>-controller": a restarted server reattaches
    num_frontends: int = 1  # HTTP front doors (each routes; ports http.port .. http.port + n - 1)
    ray_address: str | None = None  # None: $RAY_ADDRESS if set (ray job submit), else an embedded local cluster
    num_cpus: int | None = None  # embedded cluster only (None: detect)
    node_ip_address: str = "127.0.0.1"
    dashboard_host: str = "127.0.0.1"
    num_replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 1
    tp_size: int = 1
    distributed_backend: str = "gloo"  # gloo on CPU, nccl on GPU
    num_gpus_per_rank: float = 0.0
    max_inflight: int = 4096  # accepted unfinished requests (queued, not refused); beyond this, HTTP 429
    scale_up_queue_depth: float = 4.0  # autoscaler: add a replica above this many requests per replica
    scale_down_idle_s: float = 60.0  # autoscaler: remove one after this long with nothing in flight
    autoscale_interval_s: float = 1.0
    warm_prefixes: int = 8  # hot prefixes copied onto a new replica
    # min_replicas == max_replicas: a fixed count (no autoscaler), each dead replica replaced with this backoff
    restart: ReplicaRestartConfig = field(default_factory=ReplicaRestartConfig)

    def __post_init__(self) -> None:
        if self.backend not in ("ray", "inprocess"):
            raise ConfigError(f"cluster.backend must be ray or inprocess, got {self.backend!r}")
        if self.backend == "inprocess" and (self.num_replicas != 1 or self.tp_size != 1):
            raise ConfigError("cluster.backend inprocess serves one replica with tp_size 1")
        if self.max_inflight < 1:
            raise ConfigError("cluster.max_inflight must be >= 1")
        if not 1 <= self.min_replicas <= self.num_replicas <= self.max_replicas:
            raise ConfigError("cluster: need 1 <= min_replicas <= num_replicas <= max_replicas")
        if self.tp_size < 1:
            raise ConfigError("cluster.tp_size must be >= 1")
        if self.num_frontends < 1:
            raise ConfigError("cluster.num_frontends must be >= 1")
        if self.distributed_backend not in ("gloo", "nccl"):
            raise ConfigError("cluster.distributed_backend must be gloo or nccl")


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"http.port must be in 0..65535, got {self.port}")


DTYPE_ALIASES = {"float": "float32", "half": "float16"}


@dataclass(frozen=True)
class ModelSection:
    path: str = "configs/models/tiny-trained"
    dtype: str = "float32"  # auto: the checkpoint's config.json dtype; float / half: float32 / float16
    init_config: str | None = None  # with an empty `path`: serve a random checkpoint from this YAML
    served_model_name: str | None = None  # the API's model id (None: the checkpoint dir's name)
    chat_template: str | None = None  # a Jinja file or inline template (None: the checkpoint's)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("model.served_model_name must not be empty")


@dataclass(frozen=True)
class RouterSection:
    policy: str = "hybrid"
    prefill_cost_per_token: float = 1.0
    load_cost_per_queued_token: float = 1.0
    transfer_cost_per_token: float = 0.05
    junction_credit: float = 0.5  # share of the attention match past the hit counted as saved (sticky sessions)

    def __post_init__(self) -> None:
        if not 0.0 <= self.junction_credit < 1.0:
            raise ConfigError(f"router.junction_credit must be in [0, 1), got {self.junction_credit}")
        if self.policy not in ("hybrid", "attention_overlap", "round_robin", "random"):
            choices = "hybrid, attention_overlap, round_robin or random"
            raise ConfigError(f"router.policy must be {choices}, got {self.policy!r}")

    def router_config(self):
        """The cache service's `RouterConfig` with this section's weights."""
        from cache_service.router import RouterConfig

        return RouterConfig(prefill_cost_per_token=self.prefill_cost_per_token,
                            load_cost_per_queued_token=self.load_cost_per_queued_token,
                            transfer_cost_per_token=self.transfer_cost_per_token,
                            junction_credit=self.junction_credit)


@dataclass(frozen=True)
class ServeConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterSection = field(default_factory=RouterSection)


def _check_type(path: str, value, annotation) -> None:
    origin = typing.get_origin(annotation)
    allowed = typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)
    kinds = tuple(float if a is float else a for a in allowed if isinstance(a, type))
    if type(None) in allowed and value is None:
        return
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return
    if not kinds or (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
        return
    names = " or ".join(k.__name__ for k in kinds)
    raise ConfigError(f"{path}: expected {names}, got {type(value).__name__} {value!r}")


def _build(cls, data, path: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{path + '.' if path else ''}{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    values = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, key)
        else:
            if name != "eagle_mode":
                _check_type(key, value, hint)
            values[name] = value
    try:
        return cls(**values)
    except (EngineConfigError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{path}: {exc}") from None


def _apply_override(data: dict, override: str) -> None:
    """`a.b.c=VALUE` (VALUE parsed as YAML) set into the raw config mapping."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected KEY.PATH=VALUE")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: invalid value: {exc}") from None
    try:
        _set(data, key, value)
    except ConfigError as exc:
        raise ConfigError(f"override {override!r}: {exc}") from None


def _set(data: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {part} is not a mapping")
    node[leaf] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                settings: dict[str, object] | None = None) -> ServeConfig:
    """Load and validate; `overrides` are `key.path=value` strings applied on top (e.g. `--set`),
    then `settings` (key path -> typed value, e.g. from `vllm serve`-style flags). `path` None:
    the built-in defaults."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {exc}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    for override in overrides:
        _apply_override(data, override)
    for key, value in (settings or {}).items():
        _set(data, key, value)
    return _build(ServeConfig, data, "")
