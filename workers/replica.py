"""A replica as a Ray actor: one engine on its own loop thread, streaming each request's tokens
back in batched deltas, pushing its cache events once per step, and moving prefix pages to /
from its peers (`transfer_replica.TransferMixin`) and hand-offs (`handoff_replica.HandoffMixin`).

The actor is threaded, with one Ray concurrency group per kind of call, so a busy kind never
starves another (150 long streams once occupied every thread and health checks timed out):

    streams    generate_stream: one thread per stream in flight (up to `max_streams`)
    control    health, ping, describe, abort, cache summaries, engine stats, fault injection,
               shutdown
    transfer   send_prefix / recv_prefix (they block on a peer)

Every touch of the engine goes through its `EngineRunner`, which serialises it with the step
loop. Messages across this boundary are in `workers.replica_messages`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import ray

from cache_service.messages import LoadReportMsg
from workers.engine.request import RequestOutput
from workers.event_publisher import CacheSnapshot
from workers.handoff_replica import HandoffMixin
from workers.replica_messages import GenerateMsg, ReplicaInfoMsg, WorkCountsMsg, merge_outputs
from workers.transfer import page_bytes
from workers.transfer_replica import TransferMixin

log = logging.getLogger(__name__)

STREAM_POLL_S = 0.25  # how often a stream reader checks the engine loop's health while it waits
CONCURRENCY_GROUPS = {"control": 8, "transfer": 4}  # + "streams": max_streams (see `actor_options`)


def actor_options(max_streams: int) -> dict:
    return {"concurrency_groups": {**CONCURRENCY_GROUPS, "streams": max_streams}}


class ReplicaUnhealthyError(RuntimeError):
    """This replica can no longer serve (a tensor-parallel rank died, its group broke): the
    controller drops it and serves the request elsewhere."""


class Replica:
    """The actor body (wrapped with `ray.remote` by `cluster.control.replica_set`)."""

    num_held_handoffs = 0  # packages waiting for their hand-off (`HandoffMixin` counts its own)

    def __init__(self, replica_id: str, model_dir: str, engine_config, tp_size: int = 1,
                 backend: str = "gloo", service_name: str | None = None, namespace: str | None = None,
                 max_streams: int = 512, tp_actor_options: dict | None = None) -> None:
        """`tp_actor_options`: Ray options of the TPWorker actors (ranks 1..n-1), e.g. their
        placement group bundles."""
        import torch

        from cache_service.events import EventSink
        from workers.engine.engine import LLMEngine
        from workers.engine_runner import EngineRunner
        from workers.event_publisher import EventPublisher

        torch.set_num_threads(int(os.environ.get("HYBRIDSERVE_TORCH_THREADS", "1")))
        self.replica_id = replica_id
        self.tp_size = tp_size
        self.events = EventSink(replica_id)
        if tp_size > 1:
            from workers.tp_worker import create_tp_engine

            engine = create_tp_engine(model_dir, engine_config, tp_size, backend=backend, events=self.events,
                                      ray_actor_options=tp_actor_options)
        else:
            engine = LLMEngine.from_checkpoint(model_dir, engine_config, events=self.events)
        self.runner = EngineRunner(engine, max_queued=max_streams)
        self._num_accepted = 0
        self.publisher = self.make_publisher(EventPublisher, service_name, namespace)
        self.runner.on_step = self._after_step
        self.publisher.start()
        self._broken: str | None = None  # why this replica cannot serve any more

    def make_publisher(self, cls, service_name, namespace):
        """The event publisher (a seam: test doubles return one that loses or reorders batches)."""
        return cls(self.replica_id, self.events, self._snapshot_for_resync, service_name, namespace)

    def _after_step(self, engine) -> None:
        """On the loop thread after each step: the load as of now, and wake the publisher."""
        sched = engine.scheduler
        queued = 0
        for req in (*sched.running, *sched.waiting):
            queued += max(0, req.num_prompt_tokens - req.num_computed_tokens)
            queued += max(0, req.params.max_tokens - len(req.output_token_ids))
        free = engine.cache.num_free_kv_blocks
        held = self.num_held_handoffs  # exported, not yet sent: a drain waits for them too
        self.publisher.on_step(LoadReportMsg(queued, sched.num_unfinished + held, free, self._num_accepted,
                                             engine.host_copy_price(), engine.cache.num_empty_kv_blocks))

    def _snapshot_for_resync(self) -> CacheSnapshot:
        def take(engine):
            self.events.take_batch()  # pending events are in the snapshot itself
            pools = engine.cache.pools
            return CacheSnapshot([list(p.cached) for p in pools], self.events.next_seq,
                                 [list(p.host.slots) if p.host is not None else [] for p in pools])

        return self.runner.call(take)

    @ray.method(concurrency_group="control")
    def attach_service(self, service_name: str, namespace: str | None = None) -> None:
        """Push events to the named cache service from now on (a resync first if not from seq 0)."""
        self.publisher.attach(service_name, namespace)

    # ---- health -------------------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def health(self) -> str | None:
        """None while this replica can serve; else why not: its engine loop died or stalled (the
        runner's supervision and step heartbeat), or with tp_size > 1 a TP rank's actor exited or
        a step failed (the group is then out of step: the replica is unusable)."""
        serving = list(getattr(self.runner.engine.model, "tp_serving", ()))
        if self._broken is None and serving:
            done, _ = ray.wait(serving, num_returns=len(serving), timeout=0)
            if done:
                self._broken = f"{len(done)} tensor-parallel rank(s) exited"
        if self._broken is None:
            self._broken = self.runner.health()
        return self._broken

    def _next_output(self, stream):
        """The stream's next item, waiting in short slices so a dead or stalled loop is noticed
        (its stream may never get another item)."""
        import queue

        while True:
            try:
                return stream.get(timeout=STREAM_POLL_S)
            except queue.Empty:
                self._check_health()

    def _check_health(self) -> None:
        if self.health() is not None:
            raise ReplicaUnhealthyError(f"{self.replica_id}: {self._broken}")

    # ---- requests ---------------------------------------------------------------------------
    @ray.method(concurrency_group="streams")
    def generate_stream(self, msg: GenerateMsg) -> Iterator[RequestOutput]:
        """A Ray streaming generator of merged outputs (`merge_outputs`): every output available when the caller's
        previous item was produced is merged into one. Raises `ReplicaUnhealthyError` when this
        replica can no longer serve."""
        self._check_health()
        yield from self._relay(lambda: self._submit(msg))

    def _submit(self, msg: GenerateMsg):
        stream = self.runner.submit(list(msg.prompt_token_ids), msg.params, msg.cache_salt, msg.request_id,
                                    block_hashes=msg.block_hashes,
                                    hand_off=self._hold_handoff if msg.hand_off else None)
        self._num_accepted += 1  # after the engine has it: a report never misses it (it may count it twice)
        return stream

    def _hold_handoff(self, handoff) -> None:
        """Where an exported request waits for its hand-off (`HandoffMixin`; plain replicas never export)."""
        raise RuntimeError(f"{self.replica_id} cannot hand requests off")

    def _relay(self, start) -> Iterator[RequestOutput]:
        """The outputs of the runner stream `start()` returns, merged (`generate_stream`); raises
        `ReplicaUnhealthyError` when this replica can no longer serve."""
        from workers.engine.errors import InvalidRequestError, ServerOverloadedError
        from workers.engine_runner import StreamEnd

        try:
            stream = start()
            while True:
                item = self._next_output(stream)
                batch = []
                while item is not None and not isinstance(item, StreamEnd):
                    batch.append(item)
                    if item.finished:
                        break
                    item = stream.get_nowait()
                if batch:
                    delta = merge_outputs(batch)
                    yield delta
                    if delta.finished:
                        return
                if isinstance(item, StreamEnd):
                    if item.error is not None:
                        raise item.error
                    return
        except (InvalidRequestError, ServerOverloadedError):
            raise
        except Exception as exc:
            if self.health() is None and self.tp_size > 1:  # a failed TP step leaves the ranks out of step
                self._broken = f"a tensor-parallel step failed ({type(exc).__name__}: {str(exc)[:120]})"
            if self._broken is not None:
                raise ReplicaUnhealthyError(f"{self.replica_id}: {self._broken}") from exc
            raise

    @ray.method(concurrency_group="control")
    def abort(self, request_id: str) -> None:
        self.runner.abort(request_id)

    # ---- cache state --------------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def cache_summary(self) -> tuple[list[int], int]:
        """(cached entries per group, next event seq) at one instant on the engine loop:
        verification compares it with what the cache service holds for this replica."""
        self._check_health()
        return self.runner.call(lambda engine: ([len(p.cached) for p in engine.cache.pools], self.events.next_seq))

    @ray.method(concurrency_group="control")
    def publisher_stats(self) -> dict:
        return {"pushes": self.publisher.num_pushes, "resyncs": self.publisher.num_resyncs,
                "epoch": self.publisher.epoch}

    @ray.method(concurrency_group="control")
    def work_counts(self) -> WorkCountsMsg:
        """Prompt tokens this replica computed (not served from cache), as its engine and each TP rank count them."""
        def take(engine):
            model = engine.model
            by_rank = getattr(model, "forward_counts_by_rank", None)  # a TPModel asks its ranks
            ranks = by_rank() if by_rank is not None else [model.forward_counts]
            return WorkCountsMsg(engine.num_computed_prompt_tokens, tuple(ranks))

        return self.runner.call(take)

    @ray.method(concurrency_group="control")
    def engine_stats(self) -> dict[str, int]:
        """The engine's counters and gauges (`EngineRunner.engine_stats`, read off the loop): the
        front doors export them on /metrics, one sample per replica."""
        return self.runner.engine_stats()

    @ray.method(concurrency_group="control")
    def tp_workers(self) -> list:
        """Handles of this replica's TPWorker actors (ranks 1..n-1), e.g. to kill one."""
        return list(getattr(self.runner.engine.model, "tp_workers", ()))

    @ray.method(concurrency_group="control")
    def pin_cpus(self, cpus: tuple[int, ...]) -> tuple[int, ...]:
        """Pin this replica's process (every thread) and its TP ranks' to `cpus` (`cluster.pd`'s
        `<role>_cpus`); what the kernel reports. Raises `CpuListError` naming CPUs it refuses."""
        from workers.cpu_affinity import pin_this_process

        pinned = pin_this_process(tuple(cpus))
        if self.tp_size > 1:  # a command to the other ranks, from the loop thread (it owns the TP group)
            self.runner.call(lambda engine: engine.model.pin_cpus(tuple(cpus)))
        return pinned

    # ---- facts --------------------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def describe(self) -> ReplicaInfoMsg:
        """What the controller needs once: layout, EAGLE mode, fingerprint, limits, placement."""
        def facts(engine):
            layout = engine.cache.layout
            return (tuple(layout.describe()), engine.cache.coordinator.eagle.value, engine.config.model_fingerprint,
                    engine.vocab_size, engine.config.max_model_len, engine.cache.alignment, layout.hash_block_size,
                    page_bytes(engine.cache))  # at TP > 1 every rank's shard: what a transfer moves

        ctx = ray.get_runtime_context()
        *known, pages = self.runner.call(facts)
        return ReplicaInfoMsg(self.replica_id, *known, node_id=ctx.get_node_id(),
                              node_ip=ray.util.get_node_ip_address(), pid=os.getpid(), tp_size=self.tp_size,
                              page_bytes=pages)

    @ray.method(concurrency_group="control")
    def ping(self) -> str:
        self._check_health()
        return self.replica_id

    @ray.method(concurrency_group="control")
    def shutdown(self) -> None:
        self.publisher.stop()
        self.runner.shutdown()
        close = getattr(self.runner.engine.model, "close", None)  # TP: stops the TPWorker actors
        if close is not None:
            close()


class TransferReplica(HandoffMixin, TransferMixin, Replica):
    pass
