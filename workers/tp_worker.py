"""Starting a tensor-parallel replica: rank 0 in this process, ranks 1..n-1 elsewhere.

    create_tp_engine(dir, config, tp_size)   ranks 1..n-1 as Ray `TPWorker` actors (inside a Ray
                                             driver or actor); returns an LLMEngine over a TPModel
    launch_local_tp(dir, tp_size)            no Ray: ranks 1..n-1 as spawned processes (tests)

Both: check that tp_size divides the model (before starting anything), load the shards in parallel,
join the TP group (tcp://127.0.0.1:free port unless init_method is given), then ranks 1..n-1 run
`serve_tp_commands`. `engine.model.close()` (or `shutdown_tp_engine`) stops them.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import time

import torch

from workers.model.config import HybridModelConfig
from workers.model.loader import checkpoint_files, load_model, model_fingerprint
from workers.model.tensor_parallel import TPModel, serve_tp_commands
from workers.model.tp_group import TPGroup, free_tcp_init_method
from workers.model.tp_shard import attach_group, validate_tp_size

log = logging.getLogger(__name__)


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def check_tp_size(model_dir: str, tp_size: int) -> HybridModelConfig:
    """The checkpoint's config, after checking tp_size divides its heads, groups and MLP width."""
    config = HybridModelConfig.from_json_file(checkpoint_files(model_dir)[0])
    validate_tp_size(config, tp_size)
    return config


def load_shard(model_dir: str, tp_size: int, rank: int, *, backend: str = "gloo",
               dtype: torch.dtype = torch.float32, kernels: str = "auto"):
    """Rank `rank`'s shard (HybridForCausalLM built from the local config), not yet in a group: the
    loader streams only this rank's slices in (never the full model)."""
    device = _device(backend)
    return load_model(model_dir, dtype=dtype, device=device, kernels=kernels, tp_size=tp_size, tp_rank=rank)


class TPWorker:
    """Ray actor body of ranks 1..n-1: loads its shard on creation; `serve` joins the group and runs
    rank 0's commands until STOP."""

    def __init__(self, model_dir: str, tp_size: int, rank: int, backend: str = "gloo",
                 dtype: torch.dtype = torch.float32, kernels: str = "auto") -> None:
        torch.set_num_threads(1)
        self.rank, self.tp_size, self.backend = rank, tp_size, backend
        self.shard = load_shard(model_dir, tp_size, rank, backend=backend, dtype=dtype, kernels=kernels)

    def ready(self) -> int:
        return self.rank

    def serve(self, init_method: str, timeout_s: float = 600.0) -> int:
        group = TPGroup(self.rank, self.tp_size, init_method, self.backend, timeout_s)
        attach_group(self.shard, group)
        try:
            return serve_tp_commands(self.shard, group)
        finally:
            group.close()


def _join_rank0(model_dir: str, tp_size: int, init_method: str, backend: str, timeout_s: float, shard,
                on_close) -> TPModel:
    config = HybridModelConfig.from_json_file(checkpoint_files(model_dir)[0])
    group = TPGroup(0, tp_size, init_method, backend, timeout_s) if tp_size > 1 else None
    attach_group(shard, group)
    return TPModel(shard, config, tp_size, group, on_close)


def create_tp_engine(model_dir: str, engine_config, tp_size: int, backend: str = "gloo", events=None,
                     ray_actor_options: dict | None = None, *, init_method: str | None = None,
                     dtype: torch.dtype | None = None, timeout_s: float = 600.0):
    """An LLMEngine whose model spans tp_size ranks (weights in `dtype`, default engine_config.dtype):
    this process is rank 0, ranks 1..n-1 are
    `TPWorker` Ray actors started with `ray_actor_options` (default: {"num_gpus": 1} for nccl, Ray's
    actor defaults for gloo). They are owned by this process, so Ray ends them if it dies. With
    tp_size 1 no actor is started. Without `init_method` the group is on loopback and the actors are
    pinned to this node (unless the options carry a scheduling_strategy). Stop with
    `engine.model.close()`."""
    import ray

    from workers.engine.engine import LLMEngine

    check_tp_size(model_dir, tp_size)
    kernels = engine_config.kernels
    dtype = dtype or engine_config.torch_dtype
    if ray_actor_options is None:
        ray_actor_options = {"num_gpus": 1} if backend == "nccl" else {}
    options = dict(ray_actor_options)
    if init_method is None and "scheduling_strategy" not in options:  # loopback group: this node only
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    actor_cls = ray.remote(max_restarts=0)(TPWorker).options(**options)
    workers = [actor_cls.remote(model_dir, tp_size, r, backend, dtype, kernels) for r in range(1, tp_size)]
    serving = []

    def on_close() -> None:
        try:
            ray.get(serving, timeout=60)
        finally:
            for w in workers:
                ray.kill(w)

    try:
        ready = [w.ready.remote() for w in workers]
        shard = load_shard(model_dir, tp_size, 0, backend=backend, dtype=dtype, kernels=kernels)
        ray.get(ready, timeout=timeout_s)  # a worker that failed to load raises here, before the group
        init_method = init_method or free_tcp_init_method()
        serving.extend(w.serve.remote(init_method, timeout_s) for w in workers)
        model = _join_rank0(model_dir, tp_size, init_method, backend, timeout_s, shard, on_close)
        model.tp_workers, model.tp_serving = workers, serving  # the replica's health check watches these
    except BaseException:
        for w in workers:
            ray.kill(w)
        raise
    if not engine_config.model_fingerprint:
        engine_config = engine_config.replace(model_fingerprint=model_fingerprint(model_dir))
    try:
        return LLMEngine(model, engine_config, events=events)
    except BaseException:
        model.close()
        raise


def shutdown_tp_engine(engine) -> None:
    close = getattr(engine.model, "close", None)
    if close is not None:
        close()


def _run_local_rank(model_dir: str, tp_size: int, rank: int, init_method: str, backend: str,
                    dtype: torch.dtype, kernels: str, timeout_s: float, ready) -> None:
    if backend == "nccl":  # one process per local GPU; rank 0 keeps the caller's device
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        worker = TPWorker(model_dir, tp_size, rank, backend, dtype, kernels)
    except BaseException as exc:
        ready.put((rank, repr(exc)))
        raise
    ready.put((rank, None))
    worker.serve(init_method, timeout_s)


def _wait_ready(procs, ready, timeout_s: float) -> None:
    """Each spawned rank reports once its shard is loaded; fail fast if one dies or fails to load."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(1, len(procs) + 1))
    while pending:
        try:
            rank, error = ready.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r in pending if not procs[r - 1].is_alive()]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"TP rank(s) {dead or sorted(pending)} did not start") from None
            continue
        if error is not None:
            raise RuntimeError(f"TP rank {rank} failed to load its shard: {error}")
        pending.discard(rank)


def launch_local_tp(model_dir: str, tp_size: int, *, backend: str = "gloo", init_method: str | None = None,
                    dtype: torch.dtype = torch.float32, kernels: str = "torch",
                    timeout_s: float = 120.0) -> TPModel:
    """A TPModel with ranks 1..n-1 as spawned processes of this one (no Ray). close() joins them."""
    check_tp_size(model_dir, tp_size)
    init_method = init_method or free_tcp_init_method()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    procs = [ctx.Process(target=_run_local_rank, daemon=True,
                         args=(model_dir, tp_size, r, init_method, backend, dtype, kernels, timeout_s, ready))
             for r in range(1, tp_size)]
    for p in procs:
        p.start()

    def on_close() -> None:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()

    try:
        shard = load_shard(model_dir, tp_size, 0, backend=backend, dtype=dtype, kernels=kernels)
        _wait_ready(procs, ready, timeout_s)
        return _join_rank0(model_dir, tp_size, init_method, backend, timeout_s, shard, on_close)
    except BaseException:
        for p in procs:
            p.kill()
        raise
