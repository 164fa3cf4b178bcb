"""Every message across the controller-actor boundary (front doors <-> the detached controller).

    front door --membership()-->           <--MembershipMsg: the replicas (handles, facts, draining),
                                           versioned within the controller's epoch (a restart: a new one)
    front door --report_failure(id, why)-> the controller checks and purges (stops) the replica
    front door --note_hot(HotPrefixMsg...)  the prompts it served, to warm new replicas with
    front door --transfer(TransferMsg)-->  <--bool: pages moved (one transfer per pair at a time,
                                           whichever front door asks)
    front door --hand_off(HandoffMsg)-->   <--HandoffResultMsg: which replica now decodes the request
                                           (prefill/decode disaggregation)
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.replica_messages import ReplicaInfoMsg


@dataclass(frozen=True)
class ReplicaEntryMsg:
    replica_id: str
    actor: object  # the replica's Ray actor handle
    info: ReplicaInfoMsg
    draining: bool = False
    role: str = "mixed"  # "prefill" | "decode" with `cluster.pd` (`control.replica_roles`), else "mixed"


@dataclass(frozen=True)
class MembershipMsg:
    version: int  # changes whenever a replica joins, drains or leaves
    replicas: tuple[ReplicaEntryMsg, ...]
    service_name: str
    namespace: str | None
    epoch: str = ""  # the controller's: a restarted controller counts versions from 0 again
    num_shards: int = 1  # the cache service's shards (shard k: `cache_service.shards.shard_service_name`)


@dataclass(frozen=True)
class HotPrefixMsg:
    prompt_token_ids: tuple[int, ...]  # the prompt up to its last aligned boundary + 1
    cache_salt: str | None
    num_uses: int


@dataclass(frozen=True)
class TransferMsg:
    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None
    src_replica: str
    dst_replica: str
    num_tokens: int
    kv_only: bool = False  # the attention blocks only: a prefilling prompt's pages ahead of its hand-off


@dataclass(frozen=True)
class TransferResult:
    """The controller's answer to a `TransferMsg`: `ok` False means the request recomputes;
    `num_bytes` is the payload the source streamed (0 when it failed), in `seconds` (the link's
    time: the pair channel's set-up not counted)."""

    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class HandoffMsg:
    """Hand the request `request_id`, held by `src_replica` after its first token, to `dst_replica`."""

    request_id: str
    src_replica: str
    dst_replica: str


@dataclass(frozen=True)
class HandoffResultMsg:
    """The controller's answer to a `HandoffMsg`: the replica whose `resume_stream` serves the rest
    (`dst_replica`, or `src_replica` when it kept it: `delivered` False, `reason` why); `holder`
    None when the source could not answer (it died: the request is lost there, retried from the start)."""

    request_id: str
    holder: str | None
    delivered: bool
    num_bytes: int = 0  # crossed the pair channel
    reason: str | None = None
    num_skipped_bytes: int = 0  # rows the decoder's own prefix hit held: not sent
