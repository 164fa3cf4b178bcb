"""`hybridserve serve --config configs/local.yaml` (also `python -m cluster.serve`).

Today this serves ONE engine replica in-process behind the OpenAI-compatible front end; the Ray
cluster (TP shards as actors, the cache service, the router, transfers) is the cluster issue's
remaining work and will start from the same config. Binds to the config's `http.host`
(127.0.0.1 in local mode).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from cluster.config import ConfigError, ServeConfig, load_config

log = logging.getLogger("hybridserve.serve")


def resolve_model_dir(config: ServeConfig) -> str:
    """The checkpoint dir; writes a random one from `model.init_config` if the dir is missing."""
    path = Path(config.model.path)
    if (path / "config.json").is_file():
        return str(path)
    if not config.model.init_config:
        raise ConfigError(f"model.path {str(path)!r} has no config.json and no model.init_config is set")
    from workers.model.init_model import main as init_model

    out = Path(tempfile.gettempdir()) / "hybridserve-models" / Path(config.model.init_config).stem
    if not (out / "config.json").is_file():
        log.warning("model %s missing: writing a random-weight checkpoint from %s to %s",
                    path, config.model.init_config, out)
        if init_model(["--config", config.model.init_config, "--out", str(out)]) != 0:
            raise ConfigError(f"could not write a checkpoint from {config.model.init_config}")
    return str(out)


def build_app(config: ServeConfig):
    from cluster.frontend import create_app
    from cluster.tokenizer import load_tokenizer
    from workers.engine.engine import LLMEngine
    from workers.engine_runner import EngineRunner

    model_dir = resolve_model_dir(config)
    engine = LLMEngine.from_checkpoint(model_dir, config.engine)
    runner = EngineRunner(engine)
    app = create_app(runner, Path(model_dir).name, api_key=config.http.api_key, tokenizer=load_tokenizer(model_dir),
                     max_body_bytes=config.http.max_body_bytes)
    return app, runner


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridserve serve", description=__doc__)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--port", type=int, default=None, help="override http.port")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override one config value, e.g. --set router.policy=round_robin (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, args.overrides)
        app, runner = build_app(config)
    except ConfigError as exc:
        print(f"hybridserve serve: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    try:
        uvicorn.run(app, host=config.http.host, port=args.port if args.port is not None else config.http.port,
                    log_level="info")
    finally:
        runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
