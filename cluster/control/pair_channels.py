"""The controller's book of the replica-pair channels one kind of traffic uses (prefix transfers,
`transfers.py`; hand-offs, `handoffs.py`): one move per ordered pair at a time (they share the
pair's channel), and the channel's generation, which a failure bumps so that the next move opens
a fresh channel (its keys in the rendezvous store never meet the broken one's)."""

from __future__ import annotations

import threading

ENDPOINT_TIMEOUT_S = 10.0  # asking the source replica for its channel endpoint


class PairChannels:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pair_locks: dict[tuple[str, str], threading.Lock] = {}
        self._generation: dict[tuple[str, str], int] = {}

    def lock(self, src: str, dst: str) -> threading.Lock:
        """The lock serialising moves src -> dst."""
        with self._lock:
            return self._pair_locks.setdefault((src, dst), threading.Lock())

    def generation(self, src: str, dst: str) -> int:
        return self._generation.get((src, dst), 0)

    def renew(self, src: str, dst: str) -> None:
        """After a failed move: the next one src -> dst opens a new channel."""
        self._generation[(src, dst)] = self.generation(src, dst) + 1

    def reset(self, replicas, src: str, dst: str, name: str) -> None:
        """After a failed move: `renew`, and both replicas close the failed channel (`name`, only
        it: the pair's channels of the other kind count their own generations, and one dropped
        under them would be reopened under its old name, meeting its keys left in the store).
        Not waited for: a dead end needs no dropping."""
        self.renew(src, dst)
        for here, peer in ((src, dst), (dst, src)):
            rep = replicas.get(here)
            if rep is not None:
                try:
                    rep.actor.drop_channel.remote(peer, name)
                except Exception:  # noqa: BLE001 - gone meanwhile
                    pass
