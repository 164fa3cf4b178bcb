"""`TPGroup`: the torch.distributed group joining the tensor-parallel ranks of one replica.

The group is built directly on a TCPStore (gloo on CPU, NCCL on GPU) and never registered as the
process's default group: a replica actor may already hold a default group for prefix transfers, and
every replica needs its own TP group. Only two collectives are used: broadcast from rank 0 (commands)
and sum all-reduce (after the row-parallel layers).
"""

from __future__ import annotations

import datetime
import socket
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from workers.model.errors import TensorParallelError

BACKENDS = ("gloo", "nccl")


def free_tcp_init_method(host: str = "127.0.0.1") -> str:
    """tcp://host:PORT with a port free right now (loopback by default)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def _gloo_device(host: str, rank: int):
    """Rank 0 listens on the init_method's host; the others bind their own default interface unless
    the group is on loopback (then everyone is on this machine)."""
    if rank == 0 or host == "localhost" or host.startswith("127."):
        return dist.ProcessGroupGloo.create_device(hostname=host)
    return dist.ProcessGroupGloo.create_default_device()


class TPGroup:
    """rank in [0, world_size); `device` is where collective tensors must live (cpu for gloo)."""

    def __init__(self, rank: int, world_size: int, init_method: str, backend: str = "gloo",
                 timeout_s: float = 600.0) -> None:
        if backend not in BACKENDS:
            raise TensorParallelError(f"TP backend must be one of {BACKENDS}, got {backend!r}")
        if not 0 <= rank < world_size:
            raise TensorParallelError(f"TP rank {rank} is outside world size {world_size}")
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise TensorParallelError(f"TP init_method must be tcp://HOST:PORT, got {init_method!r}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0, timeout=timeout)
        self._store = store  # keeps the rendezvous server alive on rank 0
        prefixed = dist.PrefixStore("hybridserve-tp", store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [_gloo_device(url.hostname, rank)]
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
            self.device = torch.device("cpu")
        else:
            if not dist.is_nccl_available() or not torch.cuda.is_available():
                raise TensorParallelError("TP backend 'nccl' needs CUDA and a torch build with NCCL")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.barrier()  # every rank has joined before anyone sends a command

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place, from rank 0; `tensor` must be contiguous and on `self.device`."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._pg.broadcast([tensor], opts).wait()
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place over all ranks (every rank gets the same bits)."""
        self._pg.allreduce([tensor]).wait()
        return tensor

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None and self.backend == "nccl":
            shutdown()
        self._pg = None
        self._store = None
