"""Programs the multi-host bed tests run inside a host's namespace (`NetBed.run_in`), each printing
one JSON line on stdout:

    python -m tests.cluster.netbed_driver nodes HEAD N IP   a Ray driver on the node at IP: each node's
                                                            address, and where a task pinned to
                                                            host<i> (custom resource) ran
    python -m tests.cluster.netbed_driver cross HEAD IP A B N
                                     a Ray driver on the node at IP: an actor pinned to node A
                                     (NodeAffinity), a task pinned to node B hands it N bytes
    python -m tests.cluster.netbed_driver gloo-send ADDR N     PairChannel rank 0 (hosts the store at
                                                               ADDR, prints its port), sends N bytes
    python -m tests.cluster.netbed_driver gloo-recv ADDR PORT N   rank 1: receives them, checks them
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


def cross(head: str, node_ip: str, a_ip: str, b_ip: str, num_bytes: int) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=head, _node_ip_address=node_ip, log_to_driver=False, configure_logging=False)
    node_id = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def on(ip: str) -> NodeAffinitySchedulingStrategy:
        return NodeAffinitySchedulingStrategy(node_id[ip], soft=False)

    @ray.remote(num_cpus=0)
    class Sink:
        def take(self, payload: bytes) -> tuple[str, int]:
            return ray.util.get_node_ip_address(), len(payload)

    @ray.remote(num_cpus=0)
    def hand_over(sink, n: int) -> tuple[str, str, int]:
        actor_ip, got = ray.get(sink.take.remote(bytes(n)))
        return ray.util.get_node_ip_address(), actor_ip, got

    sink = Sink.options(scheduling_strategy=on(a_ip)).remote()
    task_ip, actor_ip, got = ray.get(hand_over.options(scheduling_strategy=on(b_ip)).remote(sink, num_bytes),
                                     timeout=60)
    return {"task": task_ip, "actor": actor_ip, "bytes": got}


def gloo_send(addr: str, num_bytes: int) -> dict:
    import torch

    from workers.transfer_channel import PairChannel, StoreHost

    store = StoreHost(addr, timeout_s=30)
    print(json.dumps({"port": store.port}), flush=True)
    channel = PairChannel("netbed", 0, store.endpoint, secret="bed", store=store.store, timeout_s=30)
    channel.isend(torch.arange(num_bytes // 4, dtype=torch.int32)).wait()
    return {"sent": num_bytes}


def gloo_recv(addr: str, port: int, num_bytes: int) -> dict:
    import torch

    from workers.transfer_channel import PairChannel

    channel = PairChannel("netbed", 1, (addr, port), secret="bed", timeout_s=30)
    got = torch.empty(num_bytes // 4, dtype=torch.int32)
    channel.irecv(got).wait()
    return {"equal": bool(torch.equal(got, torch.arange(num_bytes // 4, dtype=torch.int32))),
            "bytes": got.numel() * 4}


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "nodes":
        out = nodes(args[0], int(args[1]), args[2])
    elif cmd == "cross":
        out = cross(*args[:4], int(args[4]))
    elif cmd == "gloo-send":
        out = gloo_send(args[0], int(args[1]))
    elif cmd == "gloo-recv":
        out = gloo_recv(args[0], int(args[1]), int(args[2]))
    else:
        sys.exit(f"unknown program {cmd!r}")
    print(json.dumps(out), flush=True)
