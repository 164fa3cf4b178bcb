"""Prefill/decode hand-offs between replica actors (issue 31), over the replicas' pair channels.

    prefill replica A                         controller                     decode replica B
    generate_stream(msg, hand_off=True)
      ... first token out, stream ends;
      the request exported and held here
                                              hand_off(rid, A, B):
    send_handoff(rid, B, gen)            <-   both at once, A's endpoint  ->  recv_handoff(A, endpoint, gen)
      hand_off_or_keep: send over the                                        receive_handoff_into: import,
      channel "A->B#h<gen>"; on any                                          open the request's stream
      failure re-import here (kept)                                          (or refuse: A keeps it)
                                              -> HandoffSentMsg
    resume_stream(rid) on whichever holds it now (B, or A when it kept it): the rest of the outputs

An import (here or on B) opens the request's runner stream on the loop thread in the same call as
the engine's import, so no output of the next step is missed; `resume_stream` relays it.

Nothing waits forever: a package no `send_handoff` asked for within `UNCLAIMED_TTL_S` (its front
door died before asking) is dropped, and an imported request whose stream no `resume_stream`
opened within it (the controller's answer was lost, so the front door reads the request from the
prefill replica) is aborted here. Both are swept whenever a hand-off is held or imported here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import ray

from workers.engine.errors import HandoffError
from workers.engine.request import RequestOutput
from workers.pair_channel_names import handoff_channel_name
from workers.replica_messages import HandoffSentMsg

log = logging.getLogger(__name__)

UNCLAIMED_TTL_S = 120.0  # a held package or an imported request nobody asked for, then dropped


class _StreamingImporter:
    """The engine as `receive_handoff_into` / `hand_off_or_keep` see it (each call on the loop
    thread): finishing an import also opens the request's stream, in the same call; `refuse` is the
    receiving side's test seam, asked at the reservation."""

    def __init__(self, replica: HandoffMixin, refuse: bool) -> None:
        self.replica = replica
        self.refuse = refuse

    @property
    def engine(self):
        return self.replica.runner.engine

    def reserve_import(self, meta, shapes):
        reason = self.replica.refuse_handoff(meta) if self.refuse else None
        if reason is not None:
            raise HandoffError(reason)
        return self.engine.reserve_import(meta, shapes)

    def cancel_import(self, reservation) -> None:
        self.engine.cancel_import(reservation)

    def finish_import(self, reservation, rows, sampler_state):
        result = self._opened(self.engine.finish_import(reservation, rows, sampler_state))
        self.replica._num_accepted += 1  # the load report retires what the decode placement booked here
        return result

    def import_request(self, handoff):  # hand_off_or_keep: the package back where it came from
        return self._opened(self.engine.import_request(handoff))

    def _opened(self, result):
        replica = self.replica
        stream = replica.runner.adopt_stream(result.request_id)
        replica._sweep_unclaimed()
        with replica._handoff_lock:
            replica._resumed[result.request_id] = (stream, replica._clock())
        return result


class HandoffMixin:
    """A replica's side of prefill/decode hand-offs (module docstring). Needs `TransferMixin`'s
    channels and `Replica`'s runner, `_relay`, `_on_loop` and `_after_step`."""

    _handoff_lock = threading.Lock()  # replaced per actor in `_handoff_state`
    _clock = staticmethod(time.monotonic)  # a seam for tests

    def _handoff_state(self) -> None:
        if "_held" not in self.__dict__:
            self._handoff_lock = threading.Lock()
            self._held: dict = {}  # request id -> (Handoff exported, waiting for `send_handoff`; when)
            self._resumed: dict = {}  # request id -> (runner stream of an imported request; when)

    def _hold_handoff(self, handoff) -> None:
        """The runner exported a request after its first token (on the loop thread): keep it for
        `send_handoff`."""
        self._handoff_state()
        self._sweep_unclaimed()
        with self._handoff_lock:
            self._held[handoff.meta.request_id] = (handoff, self._clock())

    @property
    def num_held_handoffs(self) -> int:
        """Packages exported here and not sent yet: the load report counts them as requests, so a
        drain does not stop this replica between a request's first token and its hand-off."""
        return len(self.__dict__.get("_held", ()))

    def _report_load(self) -> None:
        """A fresh load report (a package left: an idle replica would not step to send one)."""
        self._on_loop(lambda: self._after_step(self.runner.engine))

    def _sweep_unclaimed(self) -> None:
        """Drop held packages and abort imported requests nobody claimed within `UNCLAIMED_TTL_S`."""
        self._handoff_state()
        horizon = self._clock() - UNCLAIMED_TTL_S
        with self._handoff_lock:
            held = [r for r, (_, t) in self._held.items() if t < horizon]
            resumed = [r for r, (_, t) in self._resumed.items() if t < horizon]
            for r in held:
                del self._held[r]
            for r in resumed:
                del self._resumed[r]
        for r in held:
            log.warning("%s: hand-off package of %s never asked for: dropped", self.replica_id, r)
        for r in resumed:
            log.warning("%s: imported request %s never resumed: aborted", self.replica_id, r)
            self.runner.abort(r)

    def refuse_handoff(self, meta) -> str | None:
        """Why to refuse an incoming hand-off, or None to import it (a seam for test doubles)."""
        return None

    def corrupt_this_handoff(self, meta) -> bool:
        """Whether to flip a byte of this hand-off's first chunk on the wire (a seam for test doubles)."""
        return False

    @ray.method(concurrency_group="transfer")
    def send_handoff(self, request_id: str, peer_id: str | None, generation: int = 0) -> HandoffSentMsg:
        """Send the held `request_id` to `peer_id` (whose `recv_handoff` the controller calls at the
        same time); on any failure keep it here (`hand_off_or_keep`): it decodes here and
        `resume_stream` serves it either way (`peer_id` None: no receiver, keep it). Raises
        `HandoffError` when nothing is held under that id, or when it can be kept neither there nor
        here (the package is then held again)."""
        from workers.handoff_transfer import hand_off_or_keep, send_handoff

        self._handoff_state()
        with self._handoff_lock:
            handoff, _ = self._held.pop(request_id, (None, None))
        if handoff is None:
            raise HandoffError(f"{self.replica_id} holds no request {request_id!r} to hand off")
        corrupt = 0 if self.corrupt_this_handoff(handoff.meta) else None
        sent = []

        def send(h):  # the channel's set-up too: a failure there keeps the request here
            if peer_id is None:
                raise HandoffError("no receiver")
            channel = self._channel(handoff_channel_name(self.replica_id, peer_id, generation), 0, None)
            sent.append(send_handoff(channel, h, corrupt_chunk=corrupt))

        try:
            delivery = hand_off_or_keep(_StreamingImporter(self, refuse=False), handoff, send, on_loop=self._on_loop)
        except Exception:
            self._hold_handoff(handoff)
            raise
        self._report_load()
        return HandoffSentMsg(request_id, delivery.delivered, sent[0].num_payload_bytes if sent else 0,
                              delivery.failure, sent[0].num_skipped_bytes if sent else 0)

    @ray.method(concurrency_group="transfer")
    def recv_handoff(self, peer_id: str, endpoint: tuple[str, int], generation: int = 0) -> int:
        """Receive a hand-off from `peer_id` and import it (its stream opened for `resume_stream`);
        the bytes written. Raises as `receive_handoff_into` does (the sender then keeps it)."""
        from workers.handoff_transfer import receive_handoff_into

        self._handoff_state()
        channel = self._channel(handoff_channel_name(peer_id, self.replica_id, generation), 1, tuple(endpoint))
        imported = receive_handoff_into(_StreamingImporter(self, refuse=True), channel, on_loop=self._on_loop)
        return imported.num_bytes_written

    @ray.method(concurrency_group="streams")
    def resume_stream(self, request_id: str) -> Iterator[RequestOutput]:
        """The outputs of a request imported here (`recv_handoff`, or kept by `send_handoff`), from
        the step after its import, merged as `generate_stream`'s."""
        self._check_health()

        def start():
            self._handoff_state()
            with self._handoff_lock:
                stream, _ = self._resumed.pop(request_id, (None, None))
            if stream is None:
                raise HandoffError(f"{self.replica_id} imported no request {request_id!r}")
            return stream

        yield from self._relay(start)
