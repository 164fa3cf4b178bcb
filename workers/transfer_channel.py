"""Point-to-point channels for state-page transfer: a 2-rank torch.distributed group per
(sender, receiver) pair, so replicas can join and leave (autoscaling) without re-forming a
cluster-wide world.

    PairChannel   its own `ProcessGroupGloo` (CPU) or NCCL group over a `TCPStore` hosted by
                  the sender; rank 0 sends, rank 1 receives. The store namespace is an HMAC of the
                  channel name under a cluster secret, so only processes given that secret by the
                  controller meet (a wrong secret waits alone and times out), and the secret
                  itself never crosses the (unencrypted) store connection.
    WorldChannel  the default process group (`dist.init_process_group`), peer by rank; used by
                  two-process tests and benchmarks.

Both expose `isend(tensor)` / `irecv(tensor)` returning a work handle with `.wait()`.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import socket
from typing import Protocol

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


class Work(Protocol):
    def wait(self) -> object: ...


class Channel(Protocol):
    def isend(self, tensor: torch.Tensor) -> Work: ...

    def irecv(self, tensor: torch.Tensor) -> Work: ...


class WorldChannel:
    """Send to / receive from `peer` in the default process group."""

    def __init__(self, peer: int, group=None) -> None:
        self.peer = peer
        self.group = group

    def isend(self, tensor: torch.Tensor) -> Work:
        return dist.isend(tensor, self.peer, group=self.group)

    def irecv(self, tensor: torch.Tensor) -> Work:
        return dist.irecv(tensor, self.peer, group=self.group)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class StoreHost:
    """The sender side's rendezvous store (one per replica process, hosted lazily)."""

    def __init__(self, host: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.host = host
        self.port = free_port(host)
        self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.host, self.port


def channel_namespace(secret: str, name: str) -> str:
    """The store prefix of channel `name`: only holders of `secret` can compute it."""
    return hmac.new(secret.encode(), name.encode(), hashlib.sha256).hexdigest()


class PairChannel:
    """A 2-rank group named `name` over the store at `endpoint` (rank 0 = sender)."""

    def __init__(self, name: str, rank: int, endpoint: tuple[str, int], *, secret: str = "",
                 backend: str = "gloo", store: dist.Store | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if rank not in (0, 1):
            raise ValueError(f"a pair channel has ranks 0 and 1, got {rank}")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"hybridserve/{channel_namespace(secret, name)}", store)
        self.name, self.rank, self.backend = name, rank, backend
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        else:
            raise ValueError(f"transfer backend must be gloo or nccl, got {backend!r}")
        self._tag = 0

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def isend(self, tensor: torch.Tensor) -> Work:
        return self._group().send([tensor], self.peer, 0)

    def irecv(self, tensor: torch.Tensor) -> Work:
        return self._group().recv([tensor], self.peer, 0)

    def close(self) -> None:
        """Shut this end's group down and drop it: its sockets close, so the peer's pending
        operations fail at once ("Connection closed by peer") rather than at the timeout (a gloo
        `abort()` alone leaves them open); later calls on this end raise `RuntimeError`."""
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.shutdown()

    def _group(self):
        if self.pg is None:
            raise RuntimeError(f"pair channel {self.name!r} is closed")
        return self.pg


__all__ = ["Channel", "PairChannel", "channel_namespace", "StoreHost", "WorldChannel", "free_port"]
