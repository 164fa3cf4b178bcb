"""A replica's side of moving prefix pages to and from its peers (`TransferMixin`, mixed into
`workers.replica.TransferReplica`): one pair channel per (sender, receiver, generation), the
sender hosting the rendezvous store; `send_prefix` / `recv_prefix` stream the pages
(`workers/transfer_send.py`, `transfer_recv.py`)."""

from __future__ import annotations

import os
import threading
import time

import ray

from workers.pair_channel_names import channel_ends, transfer_channel_name


class TransferMixin:
    """Rank-to-rank state-page transfer between replicas, one pair channel per (sender, receiver).

    The sender hosts the rendezvous store; the controller hands its endpoint to the receiver.
    The store namespace carries the cluster secret given at start-up, so only this cluster's
    replicas meet on it."""

    _transfer_secret = ""
    @ray.method(concurrency_group="control")
    def set_transfer_secret(self, secret: str) -> None:
        self._transfer_secret = secret

    def _transfer_state(self):
        if not hasattr(self, "_channels"):
            self._channels: dict[str, object] = {}
            self._channel_lock = threading.Lock()
            self._store_host = None
        return self._channels

    @ray.method(concurrency_group="control")
    def channel_endpoint(self) -> tuple[str, int]:
        """Host this replica's rendezvous store (once) and return its (ip, port)."""
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

    @ray.method(concurrency_group="control")
    def channel_names(self) -> list[str]:
        """The pair channels open here ("src->dst#gen" for prefix pages, "#h<gen>" for hand-offs)."""
        return sorted(self._transfer_state())

    @ray.method(concurrency_group="control")
    def drop_channel(self, peer_id: str, name: str | None = None) -> None:
        """Forget every channel with `peer_id` (the peer's death); `name`: that channel only,
        closed (a failed transfer's or hand-off's: the pair's other channels stay)."""
        channels = self._transfer_state()
        if name is not None:
            channel = channels.pop(name, None)
            if channel is not None:
                channel.close()
            return
        for key in [n for n in channels if peer_id in channel_ends(n)]:
            channels.pop(key, None)

    @ray.method(concurrency_group="transfer")
    def send_prefix(self, prompt_token_ids: list[int], cache_salt: str | None, num_tokens: int,
                    peer_id: str, generation: int = 0, kv_only: bool = False) -> tuple[int, float]:
        """(payload bytes, seconds streaming them): the channel's set-up is not counted, so the
        seconds measure the link (`cache_service.link_costs`). `generation`: a new one after a
        failed transfer, so the new pair never meets the old one's keys left in the store.
        `kv_only`: the attention blocks only (a prompt's pages sent ahead of its hand-off)."""
        from cache_service.block_hash import RequestBlockHashes
        from workers.transfer_send import send_prefix

        engine = self.runner.engine
        hashes = RequestBlockHashes(engine.cache.layout.hash_block_size, prompt_token_ids,
                                    model_fingerprint=engine.config.model_fingerprint, cache_salt=cache_salt)
        channel = self._channel(transfer_channel_name(self.replica_id, peer_id, generation), 0, None)
        t0 = time.perf_counter()
        num_bytes = send_prefix(engine.cache, hashes, num_tokens, channel, on_loop=self._on_loop,
                                tp_size=self.tp_size, corrupt=self.corrupt_this_send(), kv_only=kv_only)
        return num_bytes, time.perf_counter() - t0

    def corrupt_this_send(self) -> bool:
        """Whether to flip a byte of this send after its checksum (a seam for test doubles)."""
        return False

    def _on_loop(self, fn):
        """Run `fn()` on the engine's loop thread (at TP > 1 it owns the TP group the rows move over)."""
        return self.runner.call(lambda _engine: fn())

    @ray.method(concurrency_group="transfer")
    def recv_prefix(self, peer_id: str, endpoint: tuple[str, int], generation: int = 0) -> int:
        from workers.transfer_recv import recv_prefix

        channel = self._channel(transfer_channel_name(peer_id, self.replica_id, generation), 1, tuple(endpoint))
        return recv_prefix(self.runner.engine.cache, channel, on_loop=self._on_loop, tp_size=self.tp_size)
