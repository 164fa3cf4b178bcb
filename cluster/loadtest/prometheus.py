"""Reads the server's `/metrics` (Prometheus text) and diffs counters across a run."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

HIT_TOKENS = "hybridserve_prefix_cache_hit_tokens_total"
PROMPT_TOKENS = "hybridserve_prompt_tokens_total"
GENERATION_TOKENS = "hybridserve_generation_tokens_total"


@dataclass(frozen=True)
class MetricsDelta:
    """Counter samples, keyed by the sample name with its labels (`name{a="b"}`)."""

    samples: dict[str, float]

    def __sub__(self, other: MetricsDelta) -> MetricsDelta:
        return MetricsDelta({k: v - other.samples.get(k, 0.0) for k, v in self.samples.items()})

    def get(self, name: str) -> float | None:
        return self.samples.get(name)

    @property
    def hit_rate(self) -> float | None:
        """Server-side prefix-cache hit rate: hit tokens / prompt tokens."""
        hits, prompts = self.get(HIT_TOKENS), self.get(PROMPT_TOKENS)
        if hits is None or not prompts:
            return None
        return hits / prompts


def parse_prometheus(text: str) -> MetricsDelta:
    """`_total` counters only (gauges and histograms are not diffable as totals)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key.split("{", 1)[0].endswith("_total"):
            try:
                samples[key] = float(value)
            except ValueError:
                continue
    return MetricsDelta(samples)


def scrape_metrics(url: str, timeout_s: float = 5.0) -> MetricsDelta | None:
    try:
        r = httpx.get(f"{url}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse_prometheus(r.text) if r.status_code == 200 else None
