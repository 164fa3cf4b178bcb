"""`hybridserve serve [MODEL] [vllm serve flags]` (also `python -m cluster.serve`, which is what
`ray job submit --working-dir . -- python -m cluster.serve --config ...` runs on a cluster).

Settings come from `--config` YAML (default `configs/local.yaml` when it exists, else the built-in
defaults), then `--set key.path=value`, then the `vllm serve`-style flags, each overriding the one
before: MODEL / `--model` (model.path; a missing dir is an error naming it, never a random
checkpoint), `--host`, `--port`, `--api-key`, `--served-model-name`, `--tensor-parallel-size`,
`--dtype`, `--max-model-len`, `--num-speculative-tokens`, `--[no-]enable-prefix-caching`,
`--chat-template`. The port is checked before anything starts.

With `cluster.backend: ray` (the default) it starts or joins Ray (an embedded local cluster bound
to 127.0.0.1 unless `cluster.ray_address` or $RAY_ADDRESS names one), the cache-service actor,
`cluster.num_replicas` replica actors (TP shards each when `cluster.tp_size` > 1), the replica
autoscaler when `min_replicas < max_replicas` (else a fixed count: each dead replica is replaced,
`cluster.restart`), and the OpenAI-compatible HTTP server on
`http.host:http.port`. `cluster.backend: inprocess` serves one engine in this process (no Ray).
Ctrl-C / SIGTERM stops the HTTP server, then every actor, cleanly. `cluster.control_cpus` pins
this process first (`move_control`), so the embedded Ray and everything it starts run there too.

At startup it logs the model's cacheability (`cache_service.cacheability`): the hit grid, the
shortest prompt that can hit under the configured EAGLE mode and retention, and what each cache
group needs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cluster.cache_profile import backend_cache_profile
from cluster.config import ClusterConfig, ConfigError, ServeConfig
from cluster.config_loader import load_config

log = logging.getLogger("hybridserve.serve")


def resolve_model_dir(config: ServeConfig) -> str:
    """The checkpoint dir. A set `model.path` must exist (a mistyped path is an error naming it, never
    random weights); only an empty `model.path` writes a random checkpoint from `model.init_config`."""
    if config.model.path:
        path = Path(config.model.path)
        if not path.is_dir():
            raise ConfigError(f"model.path {str(path)!r} does not exist")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path {str(path)!r} has no config.json")
        return str(path)
    if not config.model.init_config:
        raise ConfigError("model.path is empty and no model.init_config is set: nothing to serve")
    from workers.model.init_model import main as init_model

    out = Path(tempfile.gettempdir()) / "hybridserve-models" / Path(config.model.init_config).stem
    if not (out / "config.json").is_file():
        log.warning("model.path is empty: writing a random-weight checkpoint from %s to %s",
                    config.model.init_config, out)
        if init_model(["--config", config.model.init_config, "--out", str(out)]) != 0:
            raise ConfigError(f"could not write a checkpoint from {config.model.init_config}")
    return str(out)


@dataclass
class Server:
    """What `build_app` started; `close()` stops it all (idempotent)."""

    app: object
    backend: object
    autoscaler: object | None = None
    embedded_ray: bool = False
    closed: bool = False
    frontdoors: list = field(default_factory=list)  # extra front-door actors (cluster.num_frontends > 1)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for door in self.frontdoors:
            import ray

            ray.kill(door)
        if self.autoscaler is not None:
            self.autoscaler.stop()
        self.backend.shutdown()
        if self.embedded_ray:
            import ray

            ray.shutdown()


def move_control(c: ClusterConfig) -> ClusterConfig:
    """Pin this process to `cluster.control_cpus` (none: nothing), before it starts anything: an
    embedded Ray's daemons and every actor they start inherit it. Replicas with no CPU list of
    their own then pin back to the CPUs this process had (`replica_cpus`), so only the control
    plane moves. Raises `ConfigError` naming CPUs this host does not have."""
    cpus = c.control_cpu_list
    if cpus is None:
        return c
    from workers.cpu_affinity import CpuListError, allowed_cpus, pin_this_process

    before = allowed_cpus()
    try:
        pinned = pin_this_process(cpus)
    except CpuListError as exc:
        raise ConfigError(f"cluster.control_cpus: {exc}") from None
    log.info("serving process and its control plane pinned to CPUs %s", list(pinned))
    if c.replica_cpus is None and c.backend == "ray":
        c = dataclasses.replace(c, replica_cpus=before)
    return c


def build_backend(config: ServeConfig, model_dir: str):
    """The serving backend and, for Ray, the autoscaler and whether Ray was started here."""
    c = config.cluster
    dtype = config.model.dtype
    if dtype == "auto":  # the checkpoint's own config.json dtype (float32 when it names none)
        from workers.model.loader import resolve_dtype

        dtype = str(resolve_dtype(Path(model_dir), "auto")).removeprefix("torch.")
    engine_config = config.engine.replace(dtype=dtype)  # model.dtype: weights, activations, KV
    c = move_control(c)
    if c.backend == "inprocess":
        from workers.engine.engine import LLMEngine
        from workers.engine_runner import EngineRunner

        return EngineRunner(LLMEngine.from_checkpoint(model_dir, engine_config), max_queued=c.max_inflight), None, False
    if c.node_ip_address.startswith("127.") and (c.ray_address or os.environ.get("RAY_ADDRESS", "127.")).startswith(
            ("127.", "localhost")):
        # loopback only: Ray reads this when first imported (below); without it, workers report
        # and bind this machine's outward address (the transfer stores among them)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from cluster.control.ray_cluster import connect_ray
    from cluster.frontdoor.backend import ClusterBackend

    how = connect_ray(c.ray_address, c.node_ip_address, c.dashboard_host, c.num_cpus)
    backend = ClusterBackend(model_dir, engine_config, c, config.router)
    return backend, backend.autoscaler, how == "embedded"  # the autoscaler runs in the cluster's controller


def build_app(config: ServeConfig) -> Server:
    """Raises `ConfigError` (a missing model, unreadable tokenizer files or chat template)
    before any backend is started."""
    from cluster.http.app import create_app
    from cluster.text.text_model import load_text_model

    model_dir = resolve_model_dir(config)
    try:
        text = load_text_model(model_dir, config.model.chat_template, config.model.generation_config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    backend, autoscaler, embedded = build_backend(config, model_dir)
    model_name = config.model.served_model_name or Path(model_dir).name
    try:
        profile = backend_cache_profile(backend, config.engine)
        log.info("%s", "\n".join(profile.lines(model_name)))
        app = create_app(backend, model_name, api_key=config.http.api_key, max_body_bytes=config.http.max_body_bytes,
                         text=text, model_root=model_dir, cache_profile=profile,
                         max_explained_requests=config.http.max_explained_requests)
    except Exception:
        Server(None, backend, autoscaler, embedded).close()
        raise
    server = Server(app, backend, autoscaler, embedded)
    if config.cluster.backend == "ray" and config.cluster.num_frontends > 1:  # see cluster.frontdoors
        from cluster.frontdoors import start_frontdoors

        server.frontdoors = start_frontdoors(
            config.cluster.num_frontends - 1, model_dir, backend.engine_config, config.cluster, config.http.host,
            config.http.port + 1, api_key=config.http.api_key, max_body_bytes=config.http.max_body_bytes,
            model_name=config.model.served_model_name, chat_template=config.model.chat_template,
            generation_config=config.model.generation_config, router=config.router,
            max_explained_requests=config.http.max_explained_requests)
    return server


def main(argv: list[str] | None = None) -> int:
    from cluster.serve_args import check_port_free, parse_serve_args

    args, settings = parse_serve_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, args.overrides, settings)
        check_port_free(config.http.host, config.http.port)
        server = build_app(config)
    except ConfigError as exc:
        print(f"hybridserve serve: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    log.info("serving %s on http://%s:%d", config.model.path, config.http.host, config.http.port)
    try:
        uvicorn.run(server.app, host=config.http.host, port=config.http.port, log_level="info")
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
