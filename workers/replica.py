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
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None

    @classmethod
    def of(cls, prompt_token_ids, params, cache_salt: str | None = None, request_id: str | None = None):
        return cls(list(prompt_token_ids), params.max_tokens, params.temperature, params.top_p, params.top_k,
                   params.seed, tuple(params.stop_token_ids), params.ignore_eos, cache_salt, request_id,
                   params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                   params.min_tokens, params.logprobs)

    def sampling_params(self):
        from workers.engine.sampling import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_tokens=self.min_tokens, logprobs=self.logprobs)


class ReplicaUnhealthyError(RuntimeError):
    """This replica can no longer serve (a tensor-parallel rank died, its group broke): the
    controller drops it and serves the request elsewhere."""


EVENT_FAULTS = ("drop", "reorder")


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
        self._broken: str | None = None  # why this replica cannot serve any more
        self._event_fault: str | None = None  # fault injection: "drop" / "reorder" the next event batch
        self.fault_fired_s: float | None = None  # time.time() when an injected fault took effect

    # ---- health -------------------------------------------------------------------------------
    def health(self) -> str | None:
        """None while this replica can serve; else why not. With tp_size > 1: a TP rank's actor
        exited, or a step failed (the group is then out of step: the replica is unusable)."""
        serving = list(getattr(self.runner.engine.model, "tp_serving", ()))
        if self._broken is None and serving:
            import ray

            done, _ = ray.wait(serving, num_returns=len(serving), timeout=0)
            if done:
                self._broken = f"{len(done)} tensor-parallel rank(s) exited"
        return self._broken

    def _check_health(self) -> None:
        if self.health() is not None:
            raise ReplicaUnhealthyError(f"{self.replica_id}: {self._broken}")

    # ---- requests ---------------------------------------------------------------------------
    def generate_stream(self, msg: GenerateMsg) -> Iterator[dict]:
        """A Ray streaming generator: every output (prefill chunks, tokens, the finished one).
        Raises `ReplicaUnhealthyError` when this replica can no longer serve."""
        from workers.engine.errors import InvalidRequestError, ServerOverloadedError

        self._check_health()
        try:
            for out in self.runner.submit(msg.prompt_token_ids, msg.sampling_params(), msg.cache_salt,
                                          msg.request_id):
                yield asdict(out)
        except (InvalidRequestError, ServerOverloadedError):
            raise
        except Exception as exc:
            if self.health() is None and self.tp_size > 1:  # a failed TP step leaves the ranks out of step
                self._broken = f"a tensor-parallel step failed ({type(exc).__name__}: {str(exc)[:120]})"
            if self._broken is not None:
                raise ReplicaUnhealthyError(f"{self.replica_id}: {self._broken}") from exc
            raise

    def abort(self, request_id: str) -> None:
        self.runner.abort(request_id)

    # ---- cache state --------------------------------------------------------------------------
    def drain_events(self) -> tuple[str, list, int]:
        """(replica id, pending events, the next seq read just before draining): every event below
        that seq is in this batch or an earlier one, so a lost last batch shows as a shortfall."""
        self._check_health()
        next_seq = self.events.next_seq
        return self.replica_id, self._drain(), next_seq

    def snapshot(self) -> tuple[list[list[bytes]], int]:
        """All cached keys per group and the next event seq (a consistent resync point)."""
        self._check_health()

        def take(engine):
            return [list(p.cached) for p in engine.cache.pools], self.events.next_seq

        return self.runner.call(take)

    def drain_and_snapshot(self) -> tuple[list, list[list[bytes]], int]:
        """Pending events + a snapshot taken at the same instant (verification: after applying those
        events the cluster index must equal the snapshot)."""
        self._check_health()

        def take(engine):
            return self._drain(), [list(p.cached) for p in engine.cache.pools], self.events.next_seq

        return self.runner.call(take)

    def _drain(self) -> list:
        events = self.events.drain()
        held, self._held_events = getattr(self, "_held_events", []), []
        if held:  # a reordered single event arrives after newer ones
            events += held
        fault = self._event_fault
        if fault == "drop" and events:
            self._event_fault, self.fault_fired_s = None, time.time()
            log.warning("fault injection: %s dropped %d cache events", self.replica_id, len(events))
            return []
        if fault == "reorder" and len(events) >= 2:
            self._event_fault, self.fault_fired_s = None, time.time()
            log.warning("fault injection: %s reordered %d cache events", self.replica_id, len(events))
            return events[1:] + events[:1]
        if fault == "reorder" and events:  # one event: hold it back behind the next batch
            self._event_fault, self.fault_fired_s = None, time.time()
            self._held_events = events
            return []
        return events

    # ---- fault injection (tests, `python -m bench.faults`) -------------------------------------
    def inject_event_fault(self, kind: str) -> None:
        """Drop ("drop") or reorder ("reorder") the next event batch that has enough events."""
        if kind not in EVENT_FAULTS:
            raise ValueError(f"event fault must be one of {EVENT_FAULTS}, got {kind!r}")
        self._event_fault, self.fault_fired_s = kind, None

    def evict_cached(self) -> int:
        """Evict every cached page not in use right now (as memory pressure would). Returns how many."""
        def evict(engine):
            n = 0
            for pool in engine.cache.pools:
                n += sum(pool.evict(key) for key in list(pool.cached))
            return n

        n = self.runner.call(evict)
        self.fault_fired_s = time.time()
        return n

    def tp_workers(self) -> list:
        """Handles of this replica's TPWorker actors (ranks 1..n-1), e.g. to kill one."""
        return list(getattr(self.runner.engine.model, "tp_workers", ()))

    def fault_time(self) -> float | None:
        return self.fault_fired_s

    # ---- facts --------------------------------------------------------------------------------
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

    def ping(self) -> str:
        self._check_health()
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
    _corrupt_next_send = False

    def inject_transfer_fault(self) -> None:
        """Fault injection: flip one byte of the next prefix this replica sends (after its checksum)."""
        self._corrupt_next_send = True

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
        for name in [n for n in channels if peer_id in n.split("#")[0].split("->")]:
            channels.pop(name, None)

    def send_prefix(self, prompt_token_ids: list[int], cache_salt: str | None, num_tokens: int,
                    peer_id: str, generation: int = 0) -> int:
        """`generation`: a new one after a failed transfer, so the new pair never meets the old one's
        keys left in the store."""
        from cache_service.block_hash import RequestBlockHashes
        from workers.transfer import send_prefix

        engine = self.runner.engine
        hashes = RequestBlockHashes(engine.cache.layout.hash_block_size, prompt_token_ids,
                                    model_fingerprint=engine.config.model_fingerprint, cache_salt=cache_salt)
        channel = self._channel(f"{self.replica_id}->{peer_id}#{generation}", 0, None)
        corrupt, self._corrupt_next_send = self._corrupt_next_send, False
        if corrupt:
            self.fault_fired_s = time.time()
        return send_prefix(engine.cache, hashes, num_tokens, channel, on_loop=self._on_loop, corrupt=corrupt)

    def _on_loop(self, fn):
        return self.runner.call(lambda _engine: fn())

    def recv_prefix(self, peer_id: str, endpoint: tuple[str, int], generation: int = 0) -> int:
        from workers.transfer import recv_prefix

        channel = self._channel(f"{peer_id}->{self.replica_id}#{generation}", 1, tuple(endpoint))
        return recv_prefix(self.runner.engine.cache, channel, on_loop=self._on_loop)


class TransferReplica(TransferMixin, Replica):
    pass
