import os

# Every Ray address in the tests is loopback; Ray reads this once, when it is first imported,
# and otherwise rewrites 127.0.0.1 to this machine's non-loopback address when joining a cluster.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import random

import pytest
import torch
from hypothesis import settings

from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.model.init_model import main as init_model_main

# Property tests (hypothesis, schemathesis) are derandomized in `make test` and CI: the same
# examples every run, so a failure is reproducible and the suite cannot flake on a rare draw.
# HYPOTHESIS_PROFILE=explore brings back random exploration (and the example database) locally.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    """A local Ray cluster on loopback (2 CPUs, its own RAY_TMPDIR) for one test module."""
    import ray

    os.environ["RAY_TMPDIR"] = str(tmp_path_factory.mktemp("ray"))
    from cluster.control.ray_cluster import start_local_ray

    start_local_ray(num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("tiny")
    assert init_model_main(["--config", "configs/models/tiny-nemotron-h.yaml", "--out", str(out), "--seed", "1"]) == 0
    return str(out)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from workers.model.loader import load_model

    return load_model(tiny_dir, kernels="torch")


def make_engine(model, drafter=None, events=None, graph_backend=None, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 2048)
    kw.setdefault("cache_memory_bytes", 96 * 2**20)
    return LLMEngine(model, EngineConfig(kernels="torch", **kw), drafter=drafter, events=events,
                     graph_backend=graph_backend)


def make_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]
