"""A replica as a Ray actor: one engine (TP=1 for now) on its own loop thread, reporting cache
events to the cache service.

Messages across this boundary are small dicts/dataclasses (`GenerateMsg` in, `RequestOutput`
fields out) so that Ray never pickles engine state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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


@dataclass(frozen=True)
class ReplicaLoadMsg:
    replica_id: str
    num_unfinished: int
    extra: dict = field(default_factory=dict)


class Replica:
    """The actor body (wrapped with `ray.remote` by `cluster.ray_cluster`)."""

    def __init__(self, replica_id: str, model_dir: str, engine_config) -> None:
        import torch

        from cache_service.events import EventSink
        from workers.engine.engine import LLMEngine
        from workers.engine_runner import EngineRunner

        torch.set_num_threads(1)
        self.replica_id = replica_id
        self.events = EventSink(replica_id)
        self.runner = EngineRunner(LLMEngine.from_checkpoint(model_dir, engine_config, events=self.events))

    def generate(self, msg: GenerateMsg) -> dict:
        from workers.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p,
                                top_k=msg.top_k, seed=msg.seed, stop_token_ids=tuple(msg.stop_token_ids),
                                ignore_eos=msg.ignore_eos)
        final = None
        for out in self.runner.submit(msg.prompt_token_ids, params, msg.cache_salt, msg.request_id):
            final = out
        return asdict(final) | {"replica_id": self.replica_id}

    def drain_events(self) -> tuple[str, list]:
        return self.replica_id, self.events.drain()

    def snapshot(self) -> tuple[list[list[bytes]], int]:
        """All cached keys per group and the next event seq (a consistent resync point)."""
        def take(engine):
            return [list(p.cached) for p in engine.cache.pools], self.events.next_seq

        return self.runner.call(take)

    def load(self) -> ReplicaLoadMsg:
        return ReplicaLoadMsg(self.replica_id, self.runner.num_unfinished)

    def layout_groups(self) -> list[str]:
        return self.runner.call(lambda e: e.cache.layout.describe())

    def eagle_mode(self) -> str:
        return self.runner.call(lambda e: e.cache.coordinator.eagle.value)

    def model_fingerprint(self) -> str:
        return self.runner.call(lambda e: e.config.model_fingerprint)


class TransferMixin:
    """Rank-to-rank state-page transfer between replicas over a gloo/NCCL group."""

    def init_transfer_group(self, rank: int, world_size: int, init_method: str, backend: str = "gloo") -> int:
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        self.transfer_rank = rank
        return rank

    def send_prefix(self, prompt_token_ids: list[int], cache_salt: str | None, num_tokens: int, dst: int) -> int:
        from cache_service.block_hash import RequestBlockHashes
        from workers.transfer import export_prefix, send_prefix

        def export(engine):
            hashes = RequestBlockHashes(engine.cache.layout.hash_block_size, prompt_token_ids,
                                        model_fingerprint=engine.config.model_fingerprint, cache_salt=cache_salt)
            return export_prefix(engine.cache, hashes, num_tokens)

        header, payload = self.runner.call(export)
        send_prefix(header, payload, dst)
        return payload.numel()

    def recv_prefix(self, src: int) -> int:
        from workers.transfer import import_prefix, recv_prefix

        header, payload = recv_prefix(src)
        return self.runner.call(lambda engine: import_prefix(engine.cache, header, payload))


class TransferReplica(TransferMixin, Replica):
    pass
