"""A front door's half of prefill/decode disaggregation (`cluster.pd`): which decode replica takes a
request once its prefill replica has streamed the first token, and asking the controller to hand
it over (`control/handoffs.py` moves it over the pair's channel).

    pick_decoder   the live decode replica with the fewest of this front door's requests (ties: the
                   first by id); its count is reserved at once. Prefix holding is not weighed: an
                   import computes no prompt token on any decoder, a hit there only saves page writes
    hand_off       the controller's answer names the replica that decodes the request now: the
                   decoder, or the prefill replica itself when the hand-off failed (it keeps and
                   finishes the request: `workers.handoff_transfer.hand_off_or_keep`); `counts` by
                   outcome. No answer at all (the controller died): the stream is broken and the
                   request is served again from the start (`request_streams.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import ray

from cluster.frontdoor.membership import MembershipView
from cluster.messages import HandoffMsg

log = logging.getLogger(__name__)


class DecodeHandoffs:
    def __init__(self, replicas: MembershipView, lock) -> None:
        """`lock`: the front door's, guarding every replica's `num_inflight`."""
        self.replicas = replicas
        self._lock = lock
        self.counts = {"handoffs": 0, "handoffs_kept": 0}  # this front door's, by outcome

    def pick_decoder(self) -> str | None:
        """The decode replica for the next hand-off (module doc), its count reserved; None if there
        is none."""
        with self._lock:
            loads = {r: rep.num_inflight for r, rep in self.replicas.replicas.items()
                     if rep.role == "decode" and not rep.draining}
            if not loads:
                return None
            target = min(sorted(loads), key=loads.get)
            self.replicas.get(target).num_inflight += 1
            return target

    def hand_off(self, controller, request_id: str, src: str, release: Callable[[str], None]) -> str:
        """The replica decoding `request_id` after the controller's hand-off from `src` (`release`
        gives back a decoder's reserved count when it does not take the request). Raises
        `StreamBrokenError` when there is no answer or no holder."""
        from cluster.frontdoor.request_streams import StreamBrokenError

        dst = self.pick_decoder()
        try:
            result = ray.get(controller.hand_off.remote(HandoffMsg(request_id, src, dst or "")))
        except Exception as exc:  # noqa: BLE001 - the controller died mid-hand-off: retry from the start
            result = None
            log.warning("hand-off of %s not done: %s", request_id, exc)
        if dst is not None and (result is None or result.holder != dst):
            release(dst)
        if result is None or result.holder is None:
            raise StreamBrokenError(f"hand-off of {request_id} from {src} failed"
                                    f"{'' if result is None else ': ' + str(result.reason)}")
        with self._lock:
            self.counts["handoffs" if result.delivered else "handoffs_kept"] += 1
        return result.holder
