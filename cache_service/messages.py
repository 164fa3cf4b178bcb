"""Every message across the cache-service boundary (front doors <-> service <-> replicas).

Small frozen dataclasses, never engine state, never tuples or dicts of loose fields:

    front door --RouteRequestMsg-->      service --RouteDecision-->            front door
    replica    --EventBatchMsg-->        service --IngestReplyMsg-->           replica
    replica    --ResyncChunkMsg...-->    service --IngestReplyMsg-->           replica

An `EventBatchMsg` is one engine step's cache events (or several, when the previous push was
still in flight) with its sequence range `[first_seq, end_seq)` and the replica's own load.
Events for one block of every group travel as one `BlockRecord` (a bitmask of groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from cache_service.block_hash import BlockHash


class RecordKind(IntEnum):
    STORED = 0
    REMOVED = 1
    CLEARED = 2  # every block of the groups in `group_mask` (both tiers); `block_hash` is None
    HOST_STORED = 3  # the page is on the replica's host tier (`host_tier.py`): a hit there costs a copy
    HOST_REMOVED = 4


@dataclass(frozen=True)
class BlockRecord:
    kind: RecordKind
    block_hash: BlockHash | None
    group_mask: int  # bit g set: the event concerns group g


@dataclass(frozen=True)
class HostCopyPrice:
    """What serving part of a hit from a replica's host tier costs there, in prompt tokens that
    replica would recompute in the same time, measured on the replica: copying an n-token host
    part (its KV blocks and the Mamba state page that ends it) costs `fixed + per_token * n`
    recomputed tokens (`workers.engine.host_copy_price`)."""

    fixed: float  # the state pages one hit copies (one per Mamba group)
    per_token: float  # one token's KV pages (every attention and draft group)
    bytes_per_s: float  # the host-to-device copy speed it was priced on (shown in /stats)

    def of(self, num_tokens: int) -> float:
        return self.fixed + self.per_token * num_tokens if num_tokens > 0 else 0.0


@dataclass(frozen=True)
class LoadReportMsg:
    """A replica's own view of its load (several front doors see the same picture)."""

    num_queued_tokens: int = 0  # prompt tokens still to prefill + output tokens still to decode
    num_requests: int = 0  # accepted, unfinished
    num_free_blocks: int = 0  # attention blocks free or evictable
    num_accepted: int = 0  # requests accepted since start (monotonic: which routed ones arrived)
    host_copy: HostCopyPrice | None = None  # None: no host tier, or not measured yet (router default)
    # attention blocks free and holding no cached page: what the replica takes without evicting
    # (None: not reported; the router then lets a transfer land there whatever it evicts)
    num_empty_blocks: int | None = None


@dataclass(frozen=True)
class EventBatchMsg:
    replica_id: str
    first_seq: int
    end_seq: int  # exclusive: the batch covers events [first_seq, end_seq)
    records: tuple[BlockRecord, ...]
    load: LoadReportMsg = LoadReportMsg()


@dataclass(frozen=True)
class IngestReplyMsg:
    accepted: bool  # False: the replica must resync (a gap, or a service that does not know it)
    next_seq: int  # the seq the service expects next from this replica
    service_epoch: str


@dataclass(frozen=True)
class ResyncChunkMsg:
    """One piece of a chunked resync. `first` starts it (clearing the replica's entries); `last`
    ends it, after which the replica's events continue at `next_seq`. Between the first and the
    last chunk the replica is routed by load only."""

    replica_id: str
    resync_id: str
    group_id: int
    keys: tuple[BlockHash, ...]
    next_seq: int
    first: bool = False
    last: bool = False
    host: bool = False  # the keys are on the replica's host tier, not its device


@dataclass(frozen=True)
class RouteRequestMsg:
    """What a front door sends to route one request: the prompt's block hashes (salt already
    folded into the chain's root), the salt itself (for sharding and logs) and the prompt length."""

    block_hashes: tuple[BlockHash, ...]
    num_prompt_tokens: int
    cache_salt: str | None = None
    num_output_tokens: int = 0  # max_tokens: counted in the chosen replica's pending load
    forced_replica: str | None = None  # route here if it is alive (tests, warm-up)
    exclude: tuple[str, ...] = ()  # replicas that just failed this request
    dry_run: bool = False  # estimates only (warming a replica): no load is booked
    # place a prefilled request's decode (`decode_placement.py`): among the candidates, by pages to
    # move and load; books only its output tokens
    decode_handoff: bool = False


@dataclass(frozen=True)
class ReplicaEstimate:
    replica_id: str
    hit_tokens: int  # what this policy believes the replica would hit
    cost: float
    attention_tokens: int = 0  # matched attention blocks there (tokens): the tie-break


@dataclass(frozen=True)
class TransferPlan:
    src_replica: str
    dst_replica: str
    num_tokens: int


@dataclass(frozen=True)
class RouteDecision:
    """`estimates` lists the chosen replica and every replica with a nonzero hit (others: 0)."""

    replica_id: str
    policy: str
    expected_hit_tokens: int
    estimates: tuple[ReplicaEstimate, ...]
    transfer: TransferPlan | None = None
    load_only: bool = False  # no usable index entry decided it (stale replica, restarted service)

    def hit_on(self, replica_id: str) -> int:
        return next((e.hit_tokens for e in self.estimates if e.replica_id == replica_id), 0)


# ---- the service's op log, followed by front doors' read replicas (`index_log`, `index_mirror`) ----
@dataclass(frozen=True)
class ReplicaMembershipOp:
    """`add_replica` (added) or `remove_replica` (not added), as the service applied it."""

    replica_id: str
    added: bool


@dataclass(frozen=True)
class WholeResyncOp:
    """`resync` in one call (tests, small caches)."""

    replica_id: str
    contents: tuple[tuple[BlockHash, ...], ...]
    next_seq: int


@dataclass(frozen=True)
class RoutedLoadOp:
    """Work a decision booked on a replica (`LoadBook.add_pending`). `origin`: the read replica
    that decided it (it booked the work itself and skips this op), or "" for the service."""

    replica_id: str
    tokens: int
    origin: str = ""


@dataclass(frozen=True)
class IndexOpsMsg:
    """Ops `[first_seq, first_seq + len(ops))` of the service instance `epoch`. `behind`: the
    follower asked for ops the log no longer holds (it must load a snapshot)."""

    epoch: str
    first_seq: int
    ops: tuple
    behind: bool = False


@dataclass(frozen=True)
class ServiceSpecMsg:
    """What a `CacheService` was built with: a read replica builds its own from it."""

    groups: tuple[str, ...]
    eagle: str
    model_fingerprint: str
    policy: str
    router_config: object  # a `router.RouterConfig` (None: defaults)
    drop_rule: str


@dataclass(frozen=True)
class IndexSnapshotMsg:
    """The service's whole routing state after op `seq - 1` (a follower resumes at `seq`)."""

    epoch: str
    seq: int
    spec: ServiceSpecMsg
    state: bytes  # pickled (holders, replicas, purged, loads): shipped as one buffer
