"""Simulate a cold request and a resend on a fresh cache: the engine's cache decisions without
the model. Used by `explain`, the property tests and the lookup benchmark.

A request runs through the same per-kind group managers as the engine's
(`cache_service.group_managers`), over a null page backend (`prefill.run_prefill`): the hit
restored, pages grown to the prompt, blocks published, Mamba snapshots taken at the planned
checkpoints, pages freed.
One publication and one junction implementation (`HybridCoordinator.junctions`) serve both."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from cache_service.block_hash import RequestBlockHashes
from cache_service.checkpoint_grid import on_grid
from cache_service.coordinator import EagleMode, HitResult, HybridCoordinator
from cache_service.hit_finders import DropRule
from cache_service.local_cache import LocalPrefixCache
from cache_service.miss_reasons import LookupReport, RecentlyEvicted, classify_miss
from cache_service.retention import CheckpointPlanner, make_retention, state_bytes_of
from cache_service.specs import CacheLayout, GroupSpec


@dataclass(frozen=True)
class Scenario:
    groups: tuple[GroupSpec, ...]
    prompt_len: int
    resend_len: int | None = None  # default: an identical resend
    eagle: EagleMode = EagleMode.OFF
    drop_rule: DropRule = DropRule.LOOKAHEAD
    draft_groups: frozenset[int] = frozenset()
    retention: str = "latest"
    num_spec_tokens: int = 0
    eagle_aware_retention: bool = True
    seed: int = 0
    vocab_size: int = 32000
    cache_salt: str | None = None
    num_blocks_per_group: tuple[int, ...] | None = None  # default: room for everything
    checkpoint_grid: str = "mamba"  # where states sit: mamba | attention (checkpoint_grid.py)

    @property
    def layout(self) -> CacheLayout:
        """The layout the cache runs: the groups with the Mamba grid moved as `checkpoint_grid` says."""
        return on_grid(CacheLayout(self.groups), self.checkpoint_grid)[0]

    @property
    def spacing(self) -> int:
        """The spacing bound on states the grid leaves (0: none)."""
        return on_grid(CacheLayout(self.groups), self.checkpoint_grid)[1]


@dataclass
class RequestTrace:
    num_prompt_tokens: int
    hit: HitResult
    checkpoints: tuple[int, ...]
    junctions: tuple[int, ...]
    explanation: list[str] = field(default_factory=list)
    report: LookupReport | None = None  # the lookup with its miss reason (`miss_reasons`)


@dataclass
class SimulationResult:
    scenario: Scenario
    coordinator: HybridCoordinator
    cold: RequestTrace
    resend: RequestTrace
    cache: LocalPrefixCache


def make_tokens(num_tokens: int, seed: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def run_request(
    cache: LocalPrefixCache, planner: CheckpointPlanner, tokens: list[int], salt: str | None, explain: bool,
    evicted: RecentlyEvicted | None = None,
) -> RequestTrace:
    """Look up, plan snapshots, then run the request's prefill through the group managers
    (prefill only: T = num_prompt_tokens). When the attention match outruns the reconciled hit,
    the match end is a shared-prefix junction (`HybridCoordinator.junctions`): snapshotting there
    lets the next sibling request hit. Pools too small for the whole prompt at once: nothing is
    stored (the engine would preempt or refuse it). Publication: `LocalPrefixCache.store_prefix`.
    The lookup is classified as the engine classifies it (`miss_reasons`; `evicted`: the cache's
    eviction record, None: none kept)."""
    coordinator = cache.coordinator
    hashes = RequestBlockHashes(coordinator.layout.hash_block_size, tokens, cache_salt=salt)
    probes = coordinator.probes(hashes.hashes, len(tokens), cache.lookup_view)
    hit = coordinator.reconcile(probes)
    report = LookupReport.of(len(tokens), hit, probes, classify_miss(coordinator, probes, hit, evicted or ()))
    lines = []
    if explain:
        for g, (probe, own) in enumerate(zip(probes, hit.per_group_hits)):
            lines.append(f"group {g} ({probe.spec.describe()}): {own} -- {probe.why(own)}")
        lines.append(f"reconciliation: candidates {' -> '.join(map(str, hit.candidates))}; hit {hit.hit_tokens}")
    junctions = coordinator.junctions(hit)
    planner.observe(hit.attention_match_tokens)
    n = len(tokens)
    checkpoints = planner.checkpoints(n, n, junctions)
    periodic = planner.periodic(n, n, junctions)
    if not cache.store_prefix(hashes, n, checkpoints, hit.hit_tokens, periodic).admitted and explain:
        lines.append("pools too small to hold the whole prompt: nothing stored")
    return RequestTrace(n, hit, checkpoints, junctions, lines, report)


def simulate(scenario: Scenario, explain: bool = False) -> SimulationResult:
    layout = scenario.layout
    coordinator = HybridCoordinator(layout, scenario.eagle, scenario.draft_groups, scenario.drop_rule)
    policy = make_retention(scenario.retention, layout.alignment, state_bytes_of(layout), spacing=scenario.spacing)
    planner = CheckpointPlanner(coordinator, policy, scenario.eagle_aware_retention)
    resend_len = scenario.prompt_len if scenario.resend_len is None else scenario.resend_len
    longest = max(scenario.prompt_len, resend_len)
    sizes = scenario.num_blocks_per_group or tuple(longest // g.block_size + 2 for g in layout.groups)
    cache = LocalPrefixCache(coordinator, sizes)
    evicted = RecentlyEvicted(layout, capacity=sum(sizes))
    cache.events.taps.append(evicted)
    tokens = make_tokens(longest, scenario.seed, scenario.vocab_size)
    cold = run_request(cache, planner, tokens[: scenario.prompt_len], scenario.cache_salt, explain, evicted)
    resend = run_request(cache, planner, tokens[:resend_len], scenario.cache_salt, explain, evicted)
    return SimulationResult(scenario, coordinator, cold, resend, cache)
