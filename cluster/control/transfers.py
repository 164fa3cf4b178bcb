"""Prefix-page transfers between replicas, done by the controller.

A transfer moves the pages serving a hit from `src` to `dst` over their pair channel (one at a
time per ordered pair: they share one channel); any failure is logged, that channel is closed on
both ends (the next transfer opens a fresh one; the pair's hand-off channel stays) and the
request recomputes. What to move is
`cache_service.transfer_plan`'s call; warming a new replica is `control.warmup`'s.
"""

from __future__ import annotations

import logging

import ray

from cluster.control.pair_channels import ENDPOINT_TIMEOUT_S, PairChannels
from cluster.control.replica_set import ReplicaSet
from cluster.messages import TransferResult
from workers.pair_channel_names import transfer_channel_name

log = logging.getLogger(__name__)


class Transfers:
    """The controller's page mover (whichever front door asks, one transfer per ordered pair at a
    time: they share one channel)."""

    def __init__(self, replicas: ReplicaSet, timeout_s: float = 120.0) -> None:
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.counters = {"transfers": 0, "transfer_failures": 0}
        self.channels = PairChannels()

    def transfer(self, prompt_token_ids: list[int], cache_salt: str | None, src: str, dst: str,
                 num_tokens: int) -> bool:
        """`move`, answered as whether it worked (the warmer counts transfers done)."""
        return self.move(prompt_token_ids, cache_salt, src, dst, num_tokens).ok

    def move(self, prompt_token_ids: list[int], cache_salt: str | None, src: str, dst: str,
             num_tokens: int, kv_only: bool = False) -> TransferResult:
        """Move the pages serving a `num_tokens` hit src -> dst, with the payload bytes sent; on any
        failure log why and answer not ok (the request then recomputes). `kv_only`: the attention
        blocks only (`workers.transfer.wanted_keys`: a prompt's pages sent ahead of its hand-off)."""
        with self.channels.lock(src, dst):
            gen = self.channels.generation(src, dst)  # a fresh pair after a failure
            try:
                s, d = self.replicas.get(src), self.replicas.get(dst)
                if s is None or d is None:
                    raise RuntimeError(f"{src if s is None else dst} is gone")
                endpoint = ray.get(s.actor.channel_endpoint.remote(), timeout=ENDPOINT_TIMEOUT_S)
                sent = s.actor.send_prefix.remote(prompt_token_ids, cache_salt, num_tokens, dst, gen, kv_only)
                received = d.actor.recv_prefix.remote(src, endpoint, gen)
                (num_bytes, seconds), _ = ray.get([sent, received], timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure falls back to recompute
                log.warning("transfer %s -> %s of %d tokens failed (%s): recomputing", src, dst, num_tokens, exc)
                self.counters["transfer_failures"] += 1
                # this channel only: the pair's hand-off channel is the hand-offs' (their own
                # generations), so dropping it here would make the next hand-off reopen its name
                self.channels.reset(self.replicas, src, dst, transfer_channel_name(src, dst, gen))
                return TransferResult(False)
        self.counters["transfers"] += 1
        return TransferResult(True, int(num_bytes), float(seconds))

    def forget_replica(self, replica_id: str) -> None:
        for rep in list(self.replicas.replicas.values()):
            rep.actor.drop_channel.remote(replica_id)
