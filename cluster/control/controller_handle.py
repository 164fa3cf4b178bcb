"""The controller as a front door reaches it (`cluster.frontdoor.backend`): found by its name or
started (`attach_or_start`: a detached actor Ray restarts, always), waited for while it starts or
restarts (`wait_until_ready`), stopped with its cluster (`stop_controller`); and `AutoscalerProxy`,
the autoscaler that runs in it, seen from the front door.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import ActorUnavailableError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cache_service.router import RouterConfig
from cluster.config import ClusterConfig
from cluster.control.controller import ClusterController
from cluster.ids import controller_name

CONTROLLER_MAX_RESTARTS = -1  # Ray restarts a dead controller, always (as Ray Serve's own controller)
READY_TIMEOUT_S = 300.0  # a first start loads every replica's model; a restart adopts them


def attach_or_start(cluster_name: str, namespace: str | None, model_dir: str, engine_config, config: ClusterConfig,
                    router: RouterConfig, replica_cls: type) -> tuple[object, bool]:
    """(the handle of cluster `cluster_name`'s controller, whether this call started it): the
    running one if any, else a detached one started here (it outlives the caller)."""
    try:
        return ray.get_actor(controller_name(cluster_name), namespace=namespace), False
    except ValueError:
        pass
    # on this front door's node: Ray puts an actor needing no resources on a random node under
    # any strategy but a hard affinity (off the head in 2 of 3 bed runs without, or with a soft
    # one); a restart needs that node, which the driver that started the cluster runs on
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    controller = ray.remote(ClusterController).options(
        name=controller_name(cluster_name), namespace=namespace, lifetime="detached", num_cpus=0,
        max_concurrency=64, max_restarts=CONTROLLER_MAX_RESTARTS, max_task_retries=0, get_if_exists=True,
        scheduling_strategy=here,
    ).remote(cluster_name, model_dir, engine_config, config, router, replica_cls)
    return controller, True


def wait_until_ready(controller, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Block until `controller` (a handle) answers. While Ray restarts it, calls fail with
    `ActorUnavailableError`: asked again until `timeout_s`. A controller dead for good raises."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(controller.ready.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            return
        except ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def stop_controller(controller) -> None:
    """Stop the cluster: the controller stops the replicas and the cache service (detached: nothing
    else would), a restarting one once it answers; then the controller itself, for good."""
    try:
        wait_until_ready(controller, 60)
        ray.get(controller.shutdown.remote(), timeout=60)
    except Exception:  # noqa: BLE001
        pass
    try:
        ray.kill(controller, no_restart=True)
    except Exception:  # noqa: BLE001
        pass


class AutoscalerProxy:
    """The controller's autoscaler seen from a front door (it runs in the controller)."""

    def __init__(self, controller, before, on_change) -> None:
        self.controller = controller
        self.before = before  # this front door's requests counted as of now
        self.on_change = on_change  # this front door sees the result at once

    def step(self):
        self.before()
        event = ray.get(self.controller.autoscale_step.remote())
        self.on_change()
        return event

    @property
    def history(self) -> list:
        return ray.get(self.controller.autoscale_history.remote())

    def start(self) -> None:
        """Already running in the controller."""

    def stop(self) -> None:
        """Stops with the controller."""
