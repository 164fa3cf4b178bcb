"""A replica as a Ray actor: one engine on its own loop thread, streaming each request's outputs
back, reporting cache events, and moving prefix pages to / from its peers.

The actor is threaded (`max_concurrency`), so many requests stream at once and a transfer or an
event drain never waits behind a request; every touch of the engine goes through its
`EngineRunner`, which serialises it with the step loop.

Messages across this boundary are small dicts/dataclasses (`GenerateMsg` in, `RequestOutput`
fields out) so that Ray never pickles engine state.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateMsg:
    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None
    request_id: str | None = None

    @classmethod
    def of(cls, prompt_token_ids, params, cache_salt: str | None = None, request_id: str | None = None):
        return cls(list(prompt_token_ids), params.max_tokens, params.temperature, params.top_p, params.top_k,
                   params.seed, tuple(params.stop_token_ids), params.ignore_eos, cache_salt, request_id)

    def sampling_params(self):
        from workers.engine.sampling import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos)


@dataclass(frozen=True)
class ReplicaLoadMsg:
    replica_id: str
    num_unfinished: int
    extra: dict = field(default_factory=dict)


class Replica:
    """The actor body (wrapped with `ray.remote` by `cluster.cluster_backend`)."""

    def __init__(self, replica_id: str, model_dir: str, engine_config, tp_size: int = 1,
                 backend: str = "gloo") -> None:
        import torch

        from cache_service.events import EventSink
        from workers.engine.engine import LLMEngine
        from workers.engine_runner import EngineRunner

        torch.set_num_threads(int(os.environ.get("HYBRIDSERVE_TORCH_THREADS", "1")))
        self.replica_id = replica_id
        self.tp_size = tp_size
        self.events = EventSink(replica_id)
        if tp_size > 1:
            from workers.model.tensor_parallel import create_tp_engine

            engine = create_tp_engine(model_dir, engine_config, tp_size, backend=backend, events=self.events)
        else:
            engine = LLMEngine.from_checkpoint(model_dir, engine_config, events=self.events)
        self.runner = EngineRunner(engine)

    # ---- requests ---------------------------------------------------------------------------
    def generate_stream(self, msg: GenerateMsg) -> Iterator[dict]:
        """A Ray streaming generator: every output (prefill chunks, tokens, the finished one)."""
        for out in self.runner.submit(msg.prompt_token_ids, msg.sampling_params(), msg.cache_salt, msg.request_id):
            yield asdict(out)

    def generate(self, msg: GenerateMsg) -> dict:
        *_, final = self.generate_stream(msg)
        return final | {"replica_id": self.replica_id}

    def abort(self, request_id: str) -> None:
        self.runner.abort(request_id)

    # ---- cache state --------------------------------------------------------------------------
    def drain_events(self) -> tuple[str, list]:
        return self.replica_id, self.events.drain()

    def snapshot(self) -> tuple[list[list[bytes]], int]:
        """All cached keys per group and the next event seq (a consistent resync point)."""
        def take(engine):
            return [list(p.cached) for p in engine.cache.pools], self.events.next_seq

        return self.runner.call(take)

    # ---- facts --------------------------------------------------------------------------------
    def load(self) -> ReplicaLoadMsg:
        return ReplicaLoadMsg(self.replica_id, self.runner.num_unfinished)

    def describe(self) -> dict:
        """What the controller needs once: layout, EAGLE mode, fingerprint, limits, placement."""
        import ray

        def facts(engine):
            return {"groups": engine.cache.layout.describe(), "eagle": engine.cache.coordinator.eagle.value,
                    "fingerprint": engine.config.model_fingerprint, "vocab_size": engine.vocab_size,
                    "max_model_len": engine.config.max_model_len, "alignment": engine.cache.alignment}

        info = self.runner.call(facts)
        ctx = ray.get_runtime_context()
        return info | {"replica_id": self.replica_id, "node_id": ctx.get_node_id(), "pid": os.getpid(),
                       "node_ip": ray.util.get_node_ip_address(), "tp_size": self.tp_size}

    def layout_groups(self) -> list[str]:
        return self.runner.call(lambda e: e.cache.layout.describe())

    def eagle_mode(self) -> str:
        return self.runner.call(lambda e: e.cache.coordinator.eagle.value)

    def model_fingerprint(self) -> str:
        return self.runner.call(lambda e: e.config.model_fingerprint)

    def ping(self) -> str:
        return self.replica_id

    def shutdown(self) -> None:
        self.runner.shutdown()
        close = getattr(self.runner.engine.model, "close", None)  # TP: stops the TPWorker actors
        if close is not None:
            close()


class TransferMixin:
    """Rank-to-rank state-page transfer between replicas, one pair channel per (sender, receiver).

    The sender hosts the rendezvous store; the controller hands its endpoint to the receiver.
    The store namespace carries the cluster secret given at start-up, so only this cluster's
    replicas meet on it."""

    _transfer_secret = ""

    def set_transfer_secret(self, secret: str) -> None:
        self._transfer_secret = secret

    def _transfer_state(self):
        if not hasattr(self, "_channels"):
            self._channels: dict[str, object] = {}
            self._channel_lock = threading.Lock()
            self._store_host = None
        return self._channels

    def channel_endpoint(self) -> tuple[str, int]:
        """Host this replica's rendezvous store (once) and return its (ip, port)."""
        import ray

        from workers.transfer_channel import StoreHost

        self._transfer_state()
        with self._channel_lock:
            if self._store_host is None:
                ip = ray.util.get_node_ip_address()
                if ip.startswith("127."):
                    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
                self._store_host = StoreHost(ip)
            return self._store_host.endpoint

    def _channel(self, name: str, rank: int, endpoint: tuple[str, int] | None):
        from workers.transfer_channel import PairChannel

        channels = self._transfer_state()
        if name not in channels:
            if endpoint is None:
                endpoint = self.channel_endpoint()
                store = self._store_host.store
            else:
                store = None
                if endpoint[0].startswith("127."):
                    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            channels[name] = PairChannel(name, rank, endpoint, secret=self._transfer_secret, store=store,
                                         backend=getattr(self, "transfer_backend", "gloo"))
        return channels[name]

    def drop_channel(self, peer_id: str) -> None:
        """Forget channels with `peer_id` (after a failed transfer or the peer's death)."""
        channels = self._transfer_state()
        for name in [n for n in channels if peer_id in n.split("->")]:
            channels.pop(name, None)

    def send_prefix(self, prompt_token_ids: list[int], cache_salt: str | None, num_tokens: int,
                    peer_id: str) -> int:
        from cache_service.block_hash import RequestBlockHashes
        from workers.transfer import send_prefix

        engine = self.runner.engine
        hashes = RequestBlockHashes(engine.cache.layout.hash_block_size, prompt_token_ids,
                                    model_fingerprint=engine.config.model_fingerprint, cache_salt=cache_salt)
        channel = self._channel(f"{self.replica_id}->{peer_id}", 0, None)
        return send_prefix(engine.cache, hashes, num_tokens, channel, on_loop=self._on_loop)

    def _on_loop(self, fn):
        return self.runner.call(lambda _engine: fn())

    def recv_prefix(self, peer_id: str, endpoint: tuple[str, int]) -> int:
        from workers.transfer import recv_prefix

        channel = self._channel(f"{peer_id}->{self.replica_id}", 1, tuple(endpoint))
        return recv_prefix(self.runner.engine.cache, channel, on_loop=self._on_loop)


class TransferReplica(TransferMixin, Replica):
    pass
