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
