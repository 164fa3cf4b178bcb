"""What a load test records: one `RequestRecord` per request, one `LoadTestResult` per run
(`report.summarize` turns it into the figures)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.loadtest.prometheus import MetricsDelta
from cluster.loadtest.workloads import WorkloadConfig


@dataclass
class RequestRecord:
    """What one request did; times are seconds, `start_s` from the run's start."""

    index: int
    source: str
    phase: str
    group: str
    turn: int
    num_prompt_tokens: int
    max_tokens: int
    cache_salt: str | None
    status: str = "pending"
    error: str | None = None
    start_s: float | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None  # prompt tokens the server ran through the model (usage extension)
    usage_prompt_tokens: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # gaps between token deliveries (client.SAME_DELIVERY_S)

    @property
    def ok(self) -> bool:
        return self.status == "200"

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if not self.ok or self.ttft_s is None or self.latency_s is None or not self.completion_tokens:
            return None
        return (self.latency_s - self.ttft_s) / max(self.completion_tokens - 1, 1)


@dataclass
class LoadTestResult:
    workload: str
    variant: str
    config: WorkloadConfig
    records: list[RequestRecord]
    wall_s: float
    metrics: MetricsDelta | None  # server-side counters over the run; None if /metrics was unavailable
