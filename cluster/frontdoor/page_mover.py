"""A front door's planned page moves: done by the controller where the measured link beats
recomputing, skipped (the target recomputes) where it does not.

    plan   `cache_service.transfer_plan.plan_transfer` (the route's plan, or a better holder when
           the target was forced)
    gate   `cache_service.link_costs.LinkCosts.choose`: the pages' bytes (the replica's
           `page_bytes` model) over the host pair's measured bytes/s vs the hit's tokens over the
           target's measured prefill tokens/s
    move   the controller's `transfer` (one per ordered pair at a time); its bytes and the
           link's seconds feed the pair's speed; any failure: the request recomputes

Each finished request feeds its replica's prefill speed (`observe_output`).
"""

from __future__ import annotations

import logging
import threading

import ray

from cache_service.link_costs import LinkChoice, LinkCostConfig, LinkCosts
from cluster.messages import TransferMsg, TransferResult
from workers.engine.request import RequestOutput

log = logging.getLogger(__name__)


class PageMover:
    def __init__(self, controller, replicas, config: LinkCostConfig) -> None:
        """`replicas`: the front door's `MembershipView` (each replica's host and page bytes)."""
        self.controller = controller
        self.replicas = replicas
        self.links = LinkCosts(config)
        self.counters = {"transfers_skipped_slow_link": 0, "transfer_trials": 0}
        self._lock = threading.Lock()
        self.last_choice: LinkChoice | None = None

    def choose(self, src: str, dst: str, num_tokens: int) -> LinkChoice | None:
        """The link's verdict on moving a `num_tokens` hit src -> dst; None when either is gone or
        the source cannot price its pages (the move is tried anyway and fails over to recompute)."""
        s, d = self.replicas.get(src), self.replicas.get(dst)
        if s is None or d is None or s.info.page_bytes is None:
            return None
        return self.links.choose(s.info.node_ip, d.info.node_ip, dst, num_tokens, s.info.page_bytes.of(num_tokens))

    def worth_moving(self, src: str, dst: str, num_tokens: int) -> bool:
        """Whether to move a planned `num_tokens` hit src -> dst (counted and logged when not)."""
        choice = self.choose(src, dst, num_tokens)
        with self._lock:
            self.last_choice = choice
            if choice is not None and not choice.move:
                self.counters["transfers_skipped_slow_link"] += 1
            elif choice is not None and choice.trial:
                self.counters["transfer_trials"] += 1
        if choice is not None and not choice.move:
            log.info("%s -> %s: recomputing %d tokens (%.3f s) beats moving them (%.3f s at %.1f MB/s)",
                     src, dst, num_tokens, choice.recompute_s, choice.transfer_s, choice.link_bytes_per_s / 1e6)
            return False
        return True

    def move(self, prompt_token_ids: list[int], cache_salt: str | None, src: str, dst: str,
             num_tokens: int) -> TransferResult:
        """Move the pages of a `num_tokens` hit src -> dst (the controller does it: one transfer per
        pair at a time, whichever front door asks); not ok on any failure (the request recomputes).
        A transfer done feeds the host pair's speed."""
        try:
            result = ray.get(self.controller.transfer.remote(TransferMsg(tuple(prompt_token_ids), cache_salt, src,
                                                                         dst, num_tokens)))
        except Exception:  # noqa: BLE001 - the controller died (Ray restarts it): recompute
            log.warning("transfer %s -> %s not done: the controller is down", src, dst)
            return TransferResult(False)
        s, d = self.replicas.get(src), self.replicas.get(dst)
        if result.ok and s is not None and d is not None:
            self.links.observe_transfer(s.info.node_ip, d.info.node_ip, result.num_bytes, result.seconds)
        return result

    def observe_output(self, replica_id: str, output: RequestOutput) -> None:
        """A finished request: its prompt tokens computed before the first token, and that time."""
        self.links.observe_prefill(replica_id, output.num_computed_prompt_tokens, output.ttft_s)
