"""The fault benchmark's shared records: its config, one scenario's result, and the environment
a scenario runs in (`bench.faults` runs them, `bench.fault_probes` checks outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FaultConfig:
    num_prompts: int = 4  # resend: each sent twice per scenario
    prompt_len: int = 320
    max_tokens: int = 24
    concurrency: int = 4
    fault_after_s: float = 0.2  # after the first request is in flight
    recovery_timeout_s: float = 30.0
    seed: int = 0
    cache_memory_bytes: int = 64 * 2**20


@dataclass
class ScenarioResult:
    name: str
    sent: int = 0
    completed: int = 0
    retryable_errors: int = 0
    documented_retryable: int = 0  # unseeded sampled requests that had streamed when their replica died
    lost: int = 0
    differing: int = 0
    recovery_s: float | None = None
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (self.lost == 0 and self.differing == 0 and self.recovery_s is not None
                and self.completed + self.documented_retryable == self.sent)


@dataclass
class Env:
    """One backend behind HTTP, with the workload's prompts and their cold outputs."""

    backend: object
    url: str
    config: FaultConfig
    prompts: list[list[int]]
    cold: list[list[int]]

    def params(self):
        from workers.engine.sampling_params import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=self.config.max_tokens, ignore_eos=True)
