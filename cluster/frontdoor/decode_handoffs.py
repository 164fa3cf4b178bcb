"""A front door's half of prefill/decode disaggregation (`cluster.pd`): which decode replica takes a
request once its prefill replica has streamed the first token, and asking the controller to hand
it over (`control/handoffs.py` moves it over the pair's channel).

    pick_decoder   the live decode replica the cache service places it on
                   (`cache_service.decode_placement`: the pages the hand-off must move, which the
                   decoder's own prefix hit spares, and its load, passing over one without memory
                   headroom), decided on this front door's read replica of the index as a prefill
                   route is; with no index answer, the one with the fewest of this front door's
                   requests. Its count is reserved at once
    reserve        the decoder is chosen (and its count reserved) as the prefill starts, so that
    progress       each prefill chunk's finished attention blocks go to it while the next chunk
                   computes (a kv-only prefix transfer by the controller, one in flight per
                   request, best effort; not at TP > 1, whose prefix pages do not move): the
                   hand-off then moves only the rest (its receiver shares the KV it holds:
                   `workers.engine.handoff_import`)
    hand_off       the controller's answer names the replica that decodes the request now: the
                   decoder, or the prefill replica itself when the hand-off failed (it keeps and
                   finishes the request: `workers.handoff_transfer.hand_off_or_keep`); `counts` by
                   outcome. No answer at all (the controller died): the stream is broken and the
                   request is served again from the start (`request_streams.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from cache_service.router import NoReplicaError
from cluster.frontdoor.membership import MembershipView
from cluster.frontdoor.routing_client import RoutingClient
from cluster.messages import HandoffMsg, TransferMsg
from workers.replica_messages import GenerateMsg

if TYPE_CHECKING:
    from cluster.frontdoor.request_streams import Job

log = logging.getLogger(__name__)


class DecodeHandoffs:
    def __init__(self, replicas: MembershipView, lock, routing: RoutingClient) -> None:
        """`lock`: the front door's, guarding every replica's `num_inflight`."""
        self.replicas = replicas
        self._lock = lock
        self.routing = routing
        # this front door's: hand-offs by outcome, and prompt pages sent to the decoder while prefilling
        self.counts = {"handoffs": 0, "handoffs_kept": 0, "early_page_sends": 0}

    def pick_decoder(self, msg: GenerateMsg) -> str | None:
        """The decode replica for `msg`'s hand-off (module doc), its count reserved; None if there
        is none."""
        with self._lock:
            inflight = {r: rep.num_inflight for r, rep in self.replicas.replicas.items()
                        if rep.role == "decode" and not rep.draining}
            others = tuple(r for r in self.replicas.replicas if r not in inflight)
        if not inflight:
            return None
        try:
            target, _ = self.routing.route(msg, inflight, exclude=others, role="decode")
        except NoReplicaError:
            return None
        with self._lock:
            rep = self.replicas.get(target)
            if rep is None:  # gone meanwhile: the hand-off fails and the prefill replica keeps it
                return None
            rep.num_inflight += 1
            return target

    def reserve(self, job: Job) -> None:
        """Choose the decoder as the prefill starts (`job.decoder`, its count reserved; None if
        there is none), so the prompt's pages can go to it while it prefills (`progress`)."""
        job.decoder = self.pick_decoder(job.msg)
        job.early_sent, job.early_ref = 0, None  # a retry's decoder holds none of an earlier attempt's pages

    def drop(self, job: Job, release: Callable[[str], None]) -> None:
        """The prefill leg ended without a hand-off (finished, failed, cancelled): give the
        reserved decoder back."""
        if job.decoder is not None:
            release(job.decoder)
            job.decoder = None

    def progress(self, controller, job: Job, src: str, position: int, alignment: int) -> None:
        """`src` has computed `position` tokens of the prompt: send the decoder the attention blocks
        of the aligned part not sent yet (a kv-only prefix transfer by the controller, not waited
        for; one in flight per request), so the hand-off moves only the rest. Best effort: a
        failed early send only leaves more for the hand-off."""
        n = position // alignment * alignment
        if job.decoder is None or n <= job.early_sent:
            return
        if self.replicas.get(src) is None:
            return
        if job.early_ref is not None and not ray.wait([job.early_ref], timeout=0)[0]:
            return  # the previous one is still moving: the next progress sends the lot
        job.early_sent, msg = n, job.msg
        job.early_ref = controller.transfer.remote(
            TransferMsg(tuple(msg.prompt_token_ids), msg.cache_salt, src, job.decoder, n, kv_only=True))
        with self._lock:
            self.counts["early_page_sends"] += 1

    def hand_off(self, controller, job: Job, src: str, release: Callable[[str], None]) -> str:
        """The replica decoding `job` after the controller's hand-off from `src` to its reserved
        decoder (one chosen now if none was: `release` gives back a decoder's reserved count when
        it does not take the request). Raises `StreamBrokenError` when there is no answer or no
        holder."""
        from cluster.frontdoor.request_streams import StreamBrokenError

        request_id = job.msg.request_id
        dst, job.decoder = job.decoder or self.pick_decoder(job.msg), None
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
