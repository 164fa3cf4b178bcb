"""A replica never keeps a hand-off nobody claims (`workers.handoff_replica`, `UNCLAIMED_TTL_S`): a
held package no `send_handoff` asked for is dropped, an imported request no `resume_stream` opened
is aborted in the engine. The mixin alone, with a settable clock and a runner that records aborts
(the Ray path is tests/cluster/test_pd_ray.py)."""

from types import SimpleNamespace

import pytest

from workers.engine.errors import HandoffError
from workers.handoff_replica import UNCLAIMED_TTL_S, HandoffMixin


class Bare(HandoffMixin):
    replica_id = "r0"

    def __init__(self) -> None:
        self.now = 0.0
        self.aborted: list[str] = []
        self.runner = SimpleNamespace(abort=self.aborted.append)

    def _clock(self) -> float:
        return self.now


def package(request_id: str):
    return SimpleNamespace(meta=SimpleNamespace(request_id=request_id))


def test_unclaimed_packages_are_dropped_and_unread_imports_aborted():
    """Catches: a sweep that never runs (the old package stays), one that drops everything (the
    fresh package goes too), an unread import left decoding (no abort), a claimed package swept."""
    replica = Bare()
    replica._hold_handoff(package("old"))
    replica._resumed["imported"] = (object(), 0.0)
    replica.now = UNCLAIMED_TTL_S - 1
    replica._hold_handoff(package("fresh"))
    assert set(replica._held) == {"old", "fresh"} and not replica.aborted  # nothing is old enough yet
    replica.now = UNCLAIMED_TTL_S + 1
    replica._hold_handoff(package("newest"))
    assert set(replica._held) == {"fresh", "newest"}
    assert replica.aborted == ["imported"] and not replica._resumed
    with pytest.raises(HandoffError, match="holds no request 'old'"):
        replica.send_handoff("old", "r1")


def test_held_packages_count_as_requests_until_sent():
    """A drain waits for the load report's requests to reach 0 (`Controller.remove_replica`): a
    package held between a request's first token and its hand-off must count there, and a send
    (delivered or kept) must refresh the report. Catches: a report blind to held packages (the
    drain stops the replica under them), a send that leaves the stale count (the drain waits to
    its timeout)."""
    replica = Bare()
    reports = []
    replica._on_loop = lambda fn: fn()
    replica._after_step = lambda engine: reports.append(replica.num_held_handoffs)
    imported = SimpleNamespace(import_request=lambda h: SimpleNamespace(request_id=h.meta.request_id))
    replica.runner = SimpleNamespace(engine=imported, adopt_stream=lambda rid: object(), abort=None)
    assert replica.num_held_handoffs == 0  # nothing held yet (no state made)
    replica._hold_handoff(package("a"))
    replica._hold_handoff(package("b"))
    assert replica.num_held_handoffs == 2
    sent = replica.send_handoff("b", None)  # no receiver: kept here, decoded here
    assert not sent.delivered and "b" in replica._resumed
    assert reports == [1]  # refreshed at once: "a" is still held
