"""Where a request's attempt runs, for a front door (`PlacementMixin`, mixed into
`ClusterBackend`; `request_streams.FrontDoor` is what serving a request asks of it):

    place      route among this front door's known replicas (the cache service's plan, or by load
               while it is down; with `cluster.pd` among the prefill replicas only), reserve this
               door's count on the target, and move the holder's pages there first where the link
               measured beats recomputing them (`page_mover.py`); `release` gives the count back
    decode leg with `cluster.pd`: the decode replica reserved, handed the request after its first
               token, fed the prompt's pages while it prefills (`decode_handoffs.DecodeHandoffs`)
"""

from __future__ import annotations

import logging
import time

from cache_service.transfer_plan import plan_transfer
from cluster.frontdoor.request_streams import Job
from cluster.http.metrics import route_reason
from workers.replica_messages import GenerateMsg

log = logging.getLogger(__name__)


class PlacementMixin:
    """Needs `ClusterBackend`'s config, router, replicas, routing, mover, handoffs, controller,
    metrics, limits and `_lock` (which guards the replicas' in-flight counts)."""

    @property
    def disaggregated(self) -> bool:
        return self.config.pd.enabled

    @property
    def handoff_counts(self) -> dict[str, int]:
        return self.handoffs.counts

    def hand_off(self, job: Job, src: str) -> str:
        """`request_streams.FrontDoor.hand_off` (`decode_handoffs.DecodeHandoffs`, as the three below)."""
        return self.handoffs.hand_off(self.controller, job, src, self.release)

    def reserve_decoder(self, job: Job) -> None:
        self.handoffs.reserve(job)

    def drop_decoder(self, job: Job) -> None:
        self.handoffs.drop(job, self.release)

    def prefill_progress(self, job: Job, src: str, position: int) -> None:
        self.handoffs.progress(self.controller, job, src, position, self.limits["alignment"])

    def place(self, job: Job, exclude: tuple[str, ...]) -> str:
        """Route, reserve this front door's count on the target, move pages if planned; the target.
        With `cluster.pd`, among the prefill replicas only. Raises `NoReplicaError`."""
        if job.forced is not None and self.replicas.get(job.forced) is None:
            try:
                self.replicas.refresh()  # a replica this front door has not heard of yet (just added)
            except Exception:  # noqa: BLE001 - the controller restarting: route among those known
                log.debug("membership refresh failed", exc_info=True)
        with self._lock:
            inflight = {r: rep.num_inflight for r, rep in self.replicas.replicas.items()
                        if not rep.draining and rep.role != "decode"}
            if self.disaggregated:  # the service's own pick must be a prefill replica too
                exclude = exclude + tuple(r for r, rep in self.replicas.replicas.items() if rep.role == "decode")
        role = "prefill" if self.disaggregated else "mixed"
        target, decision = self.routing.route(job.msg, inflight, job.forced, exclude, role=role)
        with self._lock:
            rep = self.replicas.get(target)
            if rep is not None:  # else gone meanwhile: the attempt fails over
                rep.num_inflight += 1
        if self.metrics is not None:
            self.metrics.record_route(self.router.policy if decision else "load_only", target,
                                      route_reason(decision, target, job.forced))
        self.on_routed(job.msg, decision, target)
        if decision is not None:
            move = plan_transfer(decision, target)
            if move is not None and self.mover.worth_moving(*move):
                self.transfer(list(job.msg.prompt_token_ids), job.msg.cache_salt, *move)
            elif move is not None and self.metrics is not None:
                self.metrics.record_transfer_skipped()
        return target

    def on_routed(self, msg: GenerateMsg, decision, target: str) -> None:
        """Called between routing a request and moving pages / serving it (a seam for test doubles)."""

    def release(self, replica_id: str) -> None:
        with self._lock:
            rep = self.replicas.get(replica_id)
            if rep is not None:
                rep.num_inflight -= 1

    def transfer(self, prompt_token_ids: list[int], cache_salt: str | None, src: str, dst: str,
                 num_tokens: int) -> bool:
        """Move the pages of a `num_tokens` hit src -> dst now (`page_mover.PageMover.move`). False
        on any failure (the request recomputes)."""
        t0 = time.perf_counter()
        result = self.mover.move(prompt_token_ids, cache_salt, src, dst, num_tokens)
        if self.metrics is not None:
            self.metrics.record_transfer(result.ok, time.perf_counter() - t0, result.num_bytes)
        return result.ok
