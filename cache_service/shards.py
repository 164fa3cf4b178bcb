"""The index split into shards by replica, and a route over them that stays exact.

    cluster.cache_service.shards: N   N cache-service actors; replica r's events, resyncs and
                                      booked load go to shard `shard_of(r, N)` only, so each shard
                                      holds the whole index of its replicas and none of the others'

A replica's reconciled hit depends on its own entries only (the coordinator's fixed point over
its groups), so each shard scores its own replicas exactly (`Router.hits`, the scatter) and the
decision over every replica (`Router.decide`, the gather: costs, loads, transfers) sees the same
hits and loads a single index would give it. `route_over` is the one route: a single service is
the one-shard case. `tests/cache_service/test_index_shards.py`: N shards decide as one service.
"""

from __future__ import annotations

import heapq
import zlib

from cache_service.decode_placement import place_decoder
from cache_service.messages import RouteDecision, RoutedLoadOp, RouteRequestMsg
from cache_service.router import NoReplicaError, ReplicaHits, RoutingPolicy


def shard_of(replica_id: str, num_shards: int) -> int:
    """The shard holding `replica_id`'s entries (stable across processes and restarts)."""
    return zlib.crc32(replica_id.encode()) % num_shards if num_shards > 1 else 0


def shard_service_name(service_name: str, shard: int) -> str:
    """Shard k's actor name: shard 0 keeps the unsharded service's name."""
    return service_name if shard == 0 else f"{service_name}-shard-{shard}"


def route_over(shards: list, msg: RouteRequestMsg) -> RouteDecision:
    """Decide `msg` over `shards` (`CacheService` states, shard k at index k; shard 0's router
    policy, tie-break generator and counters serve the decision) and book its load on the chosen
    replica's shard. Raises `NoReplicaError` when no shard knows a replica."""
    first = shards[0]
    known = [s.index.replicas.keys() for s in shards]
    candidates = set().union(*known) - set(msg.exclude) if len(shards) > 1 or msg.exclude else known[0]
    if not candidates:
        raise NoReplicaError("no live replica known to the cache service")
    router = first.router
    n = msg.num_prompt_tokens
    if router.policy in (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.RANDOM):
        scored = ReplicaHits({}, {}, False)
    elif len(shards) == 1:
        scored = router.hits(msg.block_hashes, n, None if candidates is known[0] else candidates)
    else:
        hits: dict[str, int] = {}
        attention: dict[str, int] = {}
        host: dict[str, int] = {}
        vouched = False
        for shard, keys in zip(shards, known):
            part = shard.router.hits(msg.block_hashes, n, candidates & keys)
            hits.update(part.hit_tokens)
            attention.update(part.attention_tokens)
            host.update(part.host_tokens)
            vouched |= part.any_vouched
        scored = ReplicaHits(hits, attention, vouched, host)
    loads = first.loads.view()
    by_load = first.loads.by_load()
    if len(shards) > 1:
        loads = {r: q for s in shards for r, q in s.loads.view().items()}
        by_load = heapq.merge(*(s.loads.by_load() for s in shards))
    def owner(r: str):
        return shards[shard_of(r, len(shards))]

    if msg.decode_handoff:
        block_tokens = _attention_block_tokens(router.coordinator.layout)
        free = {r: None if (b := owner(r).loads.free_blocks(r)) is None else b * block_tokens for r in candidates}
        decision = place_decoder(router.config, scored, n, msg.num_output_tokens, loads, free, candidates)
        booked = msg.num_output_tokens  # its prompt arrives computed
    else:
        prices = scored.priced(lambda r: owner(r).loads.host_copy(r))
        decision = router.decide(scored, n, loads, candidates, msg.forced_replica, by_load, prices,
                                 _room(router, owner))
        booked = n - decision.expected_hit_tokens + msg.num_output_tokens
    if not msg.dry_run:
        owner(decision.replica_id).book(RoutedLoadOp(decision.replica_id, booked, first.origin))
    first.counters["decisions"] += 1
    first.counters["load_only"] += decision.load_only
    return decision


def _room(router, owner):
    """`room(r)`: the tokens of KV replica r takes without evicting, from its last report's empty
    blocks (None: it reported none). Read only for the few replicas a transfer considers; the
    router ignores it when transfers may evict."""
    block_tokens = _attention_block_tokens(router.coordinator.layout)

    def room(replica_id: str) -> int | None:
        blocks = owner(replica_id).loads.empty_blocks(replica_id)
        return None if blocks is None else blocks * block_tokens

    return room


def _attention_block_tokens(layout) -> int:
    """Tokens per block of the attention group a replica's `num_free_blocks` counts."""
    ids = layout.attention_group_ids
    return layout.groups[ids[0]].block_size if ids else layout.hash_block_size
