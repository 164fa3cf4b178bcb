"""Programs the multi-host bed tests run inside a host's namespace (`NetBed.run_in`), each printing
one JSON line on stdout:

    python -m tests.cluster.netbed_driver nodes HEAD N IP   a Ray driver on the node at IP: each node's
                                                            address, and where a task pinned to
                                                            host<i> (custom resource) ran
"""

from __future__ import annotations

import json
import sys


def nodes(head: str, num_hosts: int, node_ip: str) -> dict:
    import ray

    ray.init(address=head, _node_ip_address=node_ip, log_to_driver=False, configure_logging=False)

    @ray.remote(num_cpus=0)
    def where() -> str:
        return ray.util.get_node_ip_address()

    pinned = [where.options(resources={f"host{i}": 0.01}).remote() for i in range(num_hosts)]
    return {"nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
            "driver": ray.util.get_node_ip_address(), "pinned": ray.get(pinned, timeout=60)}


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "nodes":
        out = nodes(args[0], int(args[1]), args[2])
    else:
        sys.exit(f"unknown program {cmd!r}")
    print(json.dumps(out), flush=True)
