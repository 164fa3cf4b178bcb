"""One config tree of frozen dataclasses, loaded from YAML and validated on load.

    ServeConfig
      cluster  ClusterConfig   Ray address (None = embedded local cluster), bind addresses, replicas, TP
        restart  ReplicaRestartConfig  a fixed count's crash-loop backoff (`control.replica_restarts`)
        cache_service  CacheServiceConfig  the index's shards and the front doors' read replicas
        pd       PDConfig          prefill/decode replica roles and their bounds (`cluster.pd_config`;
                                   default: none, all mixed)
        (autoscaler: an AutoscalerConfig derived from min/max_replicas and the scale_* keys)
      http     HttpConfig      front-end bind address, port, optional API key
      model    ModelSection    checkpoint dir, dtype, kernels
      engine   EngineConfig    (workers.engine.config) scheduler, pools, speculation, retention
      router   RouterConfig    (cache_service.router) routing policy and cost weights

Each section checks its own values; loading a YAML file onto the tree (unknown keys, wrong types,
`--set` overrides) is `cluster.config_loader`'s. Either way a bad config is one clear `ConfigError`
naming the key path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_service.router import RouterConfig
from cluster.pd_config import PDConfig
from workers.cpu_affinity import CpuListError, parse_cpu_list
from workers.engine.config import EngineConfig


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class CacheServiceConfig:
    """How the cluster-wide index is served (YAML: `cluster.cache_service`; docs/CONTROL_PLANE.md)."""

    shards: int = 1  # cache-service actors splitting the index by replica (> 1 needs read_replica)
    # each front door routes on its own copy of the index, kept in step with the cache service's op
    # log (false: one call to the cache service per batch of decisions)
    read_replica: bool = True

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.shards > 1 and not self.read_replica:
            raise ValueError("shards > 1 routes on the front doors' read replicas: set read_replica: true")


@dataclass(frozen=True)
class ReplicaRestartConfig:
    """The crash-loop backoff of a fixed-size cluster's replacements (YAML: `cluster.restart`)."""

    backoff_initial_s: float = 1.0  # wait before a slot's second replacement in a row (the first: at once)
    backoff_multiplier: float = 2.0  # each further one in a row waits this many times longer...
    backoff_max_s: float = 60.0  # ...but never longer than this
    backoff_reset_s: float = 300.0  # a replacement that ran this long without dying: the slot's count restarts

    def __post_init__(self) -> None:
        if not self.backoff_initial_s > 0:
            raise ValueError(f"backoff_initial_s must be > 0, got {self.backoff_initial_s}")
        if not self.backoff_multiplier >= 1:
            raise ValueError(f"backoff_multiplier must be >= 1, got {self.backoff_multiplier}")
        if not self.backoff_max_s >= self.backoff_initial_s:
            raise ValueError(f"backoff_max_s must be >= backoff_initial_s, got backoff_max_s="
                             f"{self.backoff_max_s} < backoff_initial_s={self.backoff_initial_s}")
        if not self.backoff_reset_s > 0:
            raise ValueError(f"backoff_reset_s must be > 0, got {self.backoff_reset_s}")

    def delay_s(self, num_failures: int) -> float:
        """Wait before the replacement after `num_failures` (>= 1) deaths or failed starts in a row."""
        if num_failures <= 1:
            return 0.0
        delay = self.backoff_initial_s
        for _ in range(num_failures - 2):
            if delay >= self.backoff_max_s or self.backoff_multiplier == 1:
                break
            delay *= self.backoff_multiplier
        return min(delay, self.backoff_max_s)


@dataclass(frozen=True)
class AutoscalerConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    scale_up_queue_depth: float = 4.0  # requests in flight per replica above which one is added
    scale_down_idle_s: float = 60.0  # nothing in flight this long: one is removed
    interval_s: float = 1.0  # between steps of `start()`'s loop
    warm_prefixes: int = 8  # hot prefixes copied onto a new replica
    # the cluster's `pd` section: enabled, each role is scaled within its own bounds and
    # min/max_replicas are the roles' sums (`control.scale_policy.decide_roles`)
    pd: PDConfig = field(default_factory=PDConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"autoscaler: need 1 <= min_replicas <= max_replicas, got min_replicas="
                             f"{self.min_replicas}, max_replicas={self.max_replicas}")
        pd = self.pd
        if pd.enabled and (self.min_replicas, self.max_replicas) != (pd.min_replicas, pd.max_replicas):
            raise ValueError(f"autoscaler: with pd, min_replicas and max_replicas are the roles' sums "
                             f"({pd.min_replicas} and {pd.max_replicas}), got {self.min_replicas} and "
                             f"{self.max_replicas}")
        if self.scale_up_queue_depth <= 0 or self.interval_s <= 0:
            raise ValueError("autoscaler: scale_up_queue_depth and interval_s must be positive")
        if self.scale_down_idle_s < 0 or self.warm_prefixes < 0:
            raise ValueError("autoscaler: scale_down_idle_s and warm_prefixes must be >= 0")


@dataclass(frozen=True)
class ClusterConfig:
    backend: str = "ray"  # ray: replicas as Ray actors + cache service; inprocess: one engine, no Ray
    name: str | None = "hybridserve"  # its controller is "<name>-controller": a restarted server reattaches
    # (None: a fresh name, a cluster of its own: tests, benchmarks)
    num_frontends: int = 1  # HTTP front doors (each routes; ports http.port .. http.port + n - 1)
    ray_address: str | None = None  # None: $RAY_ADDRESS if set (ray job submit), else an embedded local cluster
    num_cpus: int | None = None  # embedded cluster only (None: detect)
    node_ip_address: str = "127.0.0.1"
    dashboard_host: str = "127.0.0.1"
    num_replicas: int = 1
    # None: num_replicas, or with pd the sum of the roles' bounds (min == max: a fixed count, no autoscaler)
    min_replicas: int | None = None
    max_replicas: int | None = None  # None: num_replicas (with pd: max_prefill + max_decode)
    tp_size: int = 1
    distributed_backend: str = "gloo"  # gloo on CPU, nccl on GPU
    num_gpus_per_rank: float = 0.0
    num_cpus_per_rank: float = 0.0
    max_streams_per_replica: int = 512  # streams in flight per replica (its own concurrency group)
    max_inflight: int = 4096  # accepted unfinished requests (queued, not refused); beyond this, HTTP 429
    max_attempts: int = 3  # replicas tried per request (a replica that dies mid-request: the next one)
    health_interval_s: float = 2.0  # replicas pinged this often (0: only when a call fails)
    health_timeout_s: float = 10.0  # a ping unanswered this long is missed...
    health_max_missed: int = 3  # ...and this many missed in a row purge (and stop) the replica
    transfer_timeout_s: float = 120.0
    hot_prefixes: int = 32  # the most served prompts each front door remembers (what warming draws on)
    scale_up_queue_depth: float = 4.0  # autoscaler: add a replica above this many requests per replica
    scale_down_idle_s: float = 60.0  # autoscaler: remove one after this long with nothing in flight
    autoscale_interval_s: float = 1.0
    warm_prefixes: int = 8  # hot prefixes copied onto a replica the autoscaler adds
    cache_service: CacheServiceConfig = field(default_factory=CacheServiceConfig)
    # min_replicas == max_replicas: a fixed count (no autoscaler), each dead replica replaced with this backoff
    restart: ReplicaRestartConfig = field(default_factory=ReplicaRestartConfig)
    pd: PDConfig = field(default_factory=PDConfig)  # prefill/decode roles (default: all replicas mixed)
    # Linux CPU lists ("0", "0-3,8"): the serving process and what it starts (an embedded Ray's
    # daemons, the controller, the cache service, front doors) run on control_cpus, and replicas
    # without a role list (`pd.<role>_cpus`) on replica_cpus (None: with control_cpus, the CPUs the
    # serving process had before it moved; else not pinned). Keeps housekeeping off decode cores.
    control_cpus: str | int | None = None
    replica_cpus: str | int | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("ray", "inprocess"):
            raise ConfigError(f"cluster.backend must be ray or inprocess, got {self.backend!r}")
        for key in ("control_cpus", "replica_cpus"):
            self._cpu_list(key)  # parses, or raises naming the key
        if self.replica_cpus is not None and self.backend != "ray":
            raise ConfigError("cluster.replica_cpus needs cluster.backend ray (in-process, the engine runs in "
                              "the serving process: cluster.control_cpus places it)")
        self._check_pd()  # before the bounds' defaults: with pd they are the roles' sums
        for bound in ("min_replicas", "max_replicas"):
            if getattr(self, bound) is None:
                object.__setattr__(self, bound, getattr(self.pd, bound) if self.pd.enabled else self.num_replicas)
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
        if self.max_attempts < 1 or self.max_streams_per_replica < 1:
            raise ConfigError("cluster.max_attempts and cluster.max_streams_per_replica must be >= 1")
        try:
            self.autoscaler  # noqa: B018 - its own checks, at load time
        except ValueError as exc:
            raise ConfigError(f"cluster: {exc}") from None

    def _cpu_list(self, key: str) -> tuple[int, ...] | None:
        text = getattr(self, key)
        if text is None:
            return None
        try:
            return parse_cpu_list(text)
        except CpuListError as exc:
            raise ConfigError(f"cluster.{key}: {exc}") from None

    @property
    def control_cpu_list(self) -> tuple[int, ...] | None:
        """`control_cpus` parsed (None: not pinned)."""
        return self._cpu_list("control_cpus")

    def replica_cpu_list(self, role: str) -> tuple[int, ...] | None:
        """The CPUs a replica of `role` pins to: its role's list (`pd.<role>_cpus`), else
        `replica_cpus` (None: not pinned)."""
        return self.pd.cpus(role) or self._cpu_list("replica_cpus")

    def _check_pd(self) -> None:
        """With pd: the ray backend, num_replicas the roles' start counts' sum, and
        min/max_replicas (given or not) the sums of the roles' bounds."""
        pd = self.pd
        if not pd.enabled:
            return
        if self.backend != "ray":
            raise ConfigError("cluster.pd needs cluster.backend ray (the in-process backend is one engine)")
        if pd.num_replicas != self.num_replicas:
            raise ConfigError(f"cluster.pd: num_prefill + num_decode ({pd.num_prefill} + {pd.num_decode}) must "
                              f"equal cluster.num_replicas ({self.num_replicas})")
        for bound in ("min", "max"):
            given = getattr(self, f"{bound}_replicas")
            if given is not None and given != getattr(pd, f"{bound}_replicas"):
                raise ConfigError(
                    f"cluster.{bound}_replicas ({given}) must equal cluster.pd.{bound}_prefill + "
                    f"{bound}_decode ({getattr(pd, f'{bound}_prefill')} + {getattr(pd, f'{bound}_decode')}) "
                    f"with cluster.pd: bound each role there (cluster.{bound}_replicas left out is their sum)")

    @property
    def autoscaler(self) -> AutoscalerConfig | None:
        """The autoscaler's parameters; None when min_replicas == max_replicas (a fixed count, kept
        by the controller's restarter: dead replicas replaced with `restart`'s backoff). With pd:
        configured when any role's min < max, and then it scales every role within its bounds."""
        if self.min_replicas == self.max_replicas:
            return None
        return AutoscalerConfig(min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                                scale_up_queue_depth=self.scale_up_queue_depth,
                                scale_down_idle_s=self.scale_down_idle_s, interval_s=self.autoscale_interval_s,
                                warm_prefixes=self.warm_prefixes, pd=self.pd)


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    # the last N served requests' lookups `GET /v1/cache/explain/{id}` can answer for (0: none)
    max_explained_requests: int = 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"http.port must be in 0..65535, got {self.port}")
        if self.max_explained_requests < 0:
            raise ConfigError(f"http.max_explained_requests must be >= 0, got {self.max_explained_requests}")


DTYPE_ALIASES = {"float": "float32", "half": "float16"}


@dataclass(frozen=True)
class ModelSection:
    path: str = "configs/models/tiny-trained"
    dtype: str = "float32"  # auto: the checkpoint's config.json dtype; float / half: float32 / float16
    init_config: str | None = None  # with an empty `path`: serve a random checkpoint from this YAML
    served_model_name: str | None = None  # the API's model id (None: the checkpoint dir's name)
    chat_template: str | None = None  # a Jinja file or inline template (None: the checkpoint's)
    # vLLM's --generation-config: auto (the checkpoint's generation_config.json), vllm (none of its
    # sampling defaults), or a folder holding a generation_config.json
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("model.served_model_name must not be empty")
        if not self.generation_config.strip():
            raise ConfigError("model.generation_config must be auto, vllm or a folder, got ''")


@dataclass(frozen=True)
class ServeConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)  # (cache_service.router) policy and cost weights
