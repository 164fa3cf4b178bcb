"""Prefill/decode hand-offs between replicas, done by the controller as page transfers are
(`control.transfers`): the source's endpoint to the destination, `send_handoff` and `recv_handoff`
started together over their pair channel ("src->dst#h<gen>", one hand-off per ordered pair at a
time). The source decides the outcome: it keeps the request on any failure (`hand_off_or_keep`),
so a failed hand-off loses nothing; the pair's next hand-off then opens a fresh channel (a new
generation, `pair_channels.py`), and both replicas close the old one (`drop_channel` by name: the
pair's prefix-transfer channel stays).
"""

from __future__ import annotations

import logging

import ray

from cluster.control.pair_channels import ENDPOINT_TIMEOUT_S, PairChannels
from cluster.control.replica_set import ReplicaSet
from cluster.messages import HandoffMsg, HandoffResultMsg
from workers.pair_channel_names import handoff_channel_name

log = logging.getLogger(__name__)


class Handoffs:
    def __init__(self, replicas: ReplicaSet, timeout_s: float = 120.0) -> None:
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.counters = {"handoffs": 0, "handoffs_kept": 0, "handoff_failures": 0, "handoff_bytes": 0,
                         "handoff_skipped_bytes": 0}
        self.channels = PairChannels()

    def hand_off(self, msg: HandoffMsg) -> HandoffResultMsg:
        src, dst = msg.src_replica, msg.dst_replica
        with self.channels.lock(src, dst):
            s, d = self.replicas.get(src), self.replicas.get(dst)
            if s is None:
                return self._failed(msg, f"{src} is gone")
            gen = self.channels.generation(src, dst)
            received = None
            try:
                if d is None:
                    raise RuntimeError(f"{dst} is gone")
                endpoint = ray.get(s.actor.channel_endpoint.remote(), timeout=ENDPOINT_TIMEOUT_S)
                received = d.actor.recv_handoff.remote(src, endpoint, gen)
            except Exception as exc:  # noqa: BLE001 - no receiver: the source keeps it (its send fails fast)
                log.warning("hand-off %s -> %s of %s: no receiver (%s)", src, dst, msg.request_id, exc)
            try:
                sent = ray.get(s.actor.send_handoff.remote(msg.request_id, dst if received is not None else None, gen),
                               timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - the source died or could keep it nowhere
                self._renew(src, dst, gen)
                return self._failed(msg, f"{type(exc).__name__}: {exc}")
            if received is not None:
                try:
                    ray.get(received, timeout=self.timeout_s)
                except Exception as exc:  # noqa: BLE001 - the source kept it (sent.delivered is False)
                    log.info("hand-off %s -> %s of %s refused by the receiver: %s", src, dst, msg.request_id, exc)
            if not sent.delivered:
                self._renew(src, dst, gen)
                self.counters["handoffs_kept"] += 1
                log.warning("hand-off %s -> %s of %s failed (%s): %s decodes it", src, dst, msg.request_id,
                            sent.reason, src)
                return HandoffResultMsg(msg.request_id, src, False, 0, sent.reason)
            self.counters["handoffs"] += 1
            self.counters["handoff_bytes"] += sent.num_bytes
            self.counters["handoff_skipped_bytes"] += sent.num_skipped_bytes
            return HandoffResultMsg(msg.request_id, dst, True, sent.num_bytes, num_skipped_bytes=sent.num_skipped_bytes)

    def _renew(self, src: str, dst: str, gen: int) -> None:
        """The next hand-off src -> dst opens a fresh channel; both ends close this one (the pair's
        prefix-transfer channel stays)."""
        self.channels.reset(self.replicas, src, dst, handoff_channel_name(src, dst, gen))

    def _failed(self, msg: HandoffMsg, reason: str) -> HandoffResultMsg:
        self.counters["handoff_failures"] += 1
        log.warning("hand-off of %s failed: %s", msg.request_id, reason)
        return HandoffResultMsg(msg.request_id, None, False, 0, reason)
