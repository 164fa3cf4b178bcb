"""Bringing Ray up: an embedded local cluster bound to 127.0.0.1, or joining a running one.

The replicas, the cache service and the routing live in `cluster.frontdoor.backend`.
"""

from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger(__name__)

NAMESPACE = "hybridserve"


def start_local_ray(num_cpus: int | None = 2, node_ip_address: str = "127.0.0.1",
                    dashboard_host: str = "127.0.0.1", include_dashboard: bool = False) -> None:
    """Embedded cluster on loopback only (no-op if Ray is already initialised)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, namespace=NAMESPACE, _node_ip_address=node_ip_address,
                 include_dashboard=include_dashboard,
                 dashboard_host=dashboard_host, log_to_driver=False, configure_logging=False)
        log.info("started an embedded Ray cluster on %s", node_ip_address)


def connect_ray(address: str | None, node_ip_address: str = "127.0.0.1", dashboard_host: str = "127.0.0.1",
                num_cpus: int | None = None) -> str:
    """Join `address` (or $RAY_ADDRESS, as under `ray job submit`); else start an embedded cluster.
    Returns what was done: "joined" or "embedded"."""
    address = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return "joined"
    if address:
        kw = {}
        if address.startswith(("127.", "localhost")):
            # else Ray rewrites a 127.0.0.1 address to this machine's non-loopback one; Ray reads
            # this when first imported, so it only helps before that (as in `hybridserve serve`)
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            kw["_node_ip_address"] = node_ip_address
        elif not node_ip_address.startswith("127."):  # this host's address, set by the operator
            kw["_node_ip_address"] = node_ip_address
        # a fixed namespace: a restarted driver finds the running cluster's controller by name
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False, **kw)
        log.info("joined the Ray cluster at %s", address)
        return "joined"
    start_local_ray(num_cpus, node_ip_address, dashboard_host)
    return "embedded"
