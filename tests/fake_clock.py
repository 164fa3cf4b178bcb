"""An injected clock for unit tests of time-driven policies (autoscaler, restarter): no sleeps, no
wall-clock assertions; the test moves time itself."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
