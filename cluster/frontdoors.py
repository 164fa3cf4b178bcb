"""Extra front doors: `cluster.num_frontends` > 1 starts n - 1 `FrontDoor` actors beside the
server's own, each an asyncio HTTP server (the same OpenAI app) over its own `ClusterBackend`
attached to the running cluster by name. Each routes on its own (one cache-service call per
decision); load comes from the replicas' reports, so all of them see the same picture. One
front door dying loses none of the others' requests: they share nothing but the cluster.

    front door i listens on http.port + i (i = 1 .. n-1; the server itself is front door 0)
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import ray

from cache_service.router import RouterConfig
from cluster.config import ClusterConfig
from cluster.ids import frontdoor_actor_name

log = logging.getLogger(__name__)


class FrontDoor:
    """The actor body: a front door attached to cluster `cluster_name`."""

    def __init__(self, model_dir: str, engine_config, cluster_config: ClusterConfig, host: str | None = None,
                 port: int = 0, api_key: str | None = None, max_body_bytes: int = 4 * 2**20,
                 model_name: str | None = None, chat_template: str | None = None, generation_config: str = "auto",
                 router: RouterConfig | None = None, max_explained_requests: int = 1024) -> None:
        from cluster.frontdoor.backend import ClusterBackend

        self.backend = ClusterBackend(model_dir, engine_config, cluster_config, router)
        self.url: str | None = None
        if host is not None:
            self._serve_http(model_dir, host, port, api_key, max_body_bytes, model_name, chat_template,
                             generation_config, engine_config, max_explained_requests)

    def _serve_http(self, model_dir: str, host: str, port: int, api_key, max_body_bytes: int, model_name,
                    chat_template, generation_config, engine_config, max_explained_requests: int) -> None:
        import uvicorn

        from cluster.cache_profile import backend_cache_profile
        from cluster.http.app import create_app
        from cluster.text.text_model import load_text_model

        text = load_text_model(model_dir, chat_template, generation_config)
        app = create_app(self.backend, model_name or Path(model_dir).name, api_key=api_key,
                         max_body_bytes=max_body_bytes, text=text, model_root=model_dir,
                         cache_profile=backend_cache_profile(self.backend, engine_config),
                         max_explained_requests=max_explained_requests)
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        threading.Thread(target=self._server.run, name="uvicorn", daemon=True).start()
        self.url = f"http://{host}:{port}"

    def address(self) -> str | None:
        return self.url

    def generate_all(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, ...]]:
        """Serve `prompts` at once through this front door (tests, benchmarks): their outputs."""
        from workers.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        streams = [self.backend.submit(p, params) for p in prompts]
        return [tuple(list(s)[-1].token_ids) for s in streams]

    def num_unfinished(self) -> int:
        return self.backend.num_unfinished

    def shutdown(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.should_exit = True
        self.backend.shutdown(stop_cluster=False)


def start_frontdoors(n: int, model_dir: str, engine_config, cluster_config: ClusterConfig, host: str | None = None,
                     first_port: int = 0, **http) -> list:
    """Start `n` front-door actors attached to the cluster `cluster_config.name` (which must be
    running); with `host`, front door i serves HTTP on `first_port + i`. `http`: FrontDoor's
    keywords (api_key, max_body_bytes, model_name, chat_template, router, max_explained_requests)."""
    if cluster_config.name is None:
        raise ValueError("front doors attach by name: set the cluster's name")
    cls = ray.remote(num_cpus=0, max_concurrency=1024)(FrontDoor)
    doors = [cls.options(name=frontdoor_actor_name(cluster_config.name, first_port + i)).remote(
        model_dir, engine_config, cluster_config, host, first_port + i if host else 0, **http) for i in range(n)]
    ray.get([d.address.remote() for d in doors])
    return doors
