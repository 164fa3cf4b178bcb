"""`hybridserve explain`: why does a hybrid deployment hit (or not) on a resend?

Simulates a cold request and an identical or extended resend on a fresh cache and prints JSON
(`per_group_hits`, `hit_tokens`, the layout's cacheability: `shortest_hit_prompt`, `needs`; and
the resend's miss `reason`, see `cache_service.miss_reasons`). `--verbose` adds, per group, why
it stopped where it did (also printed to stderr as plain lines). Bad option values: one line on
stderr, exit 2. `explain_lookup` says the same of a lookup a server did (`/v1/cache/explain/{id}`).
"""

from __future__ import annotations

import argparse
import json
import sys

from cache_service.cacheability import CacheProfile, cache_profile
from cache_service.checkpoint_grid import on_grid
from cache_service.coordinator import EagleMode
from cache_service.hit_finders import DropRule
from cache_service.miss_reasons import LookupReport, describe_reason
from cache_service.retention import make_retention, state_bytes_of
from cache_service.simulate import Scenario, simulate
from cache_service.specs import CacheLayout, SpecError, parse_group_spec


class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hybridserve explain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", action="append", metavar="KIND:BLOCK[:WINDOW]",
                   help="a KV-cache group, in model order (repeatable): full:64, mamba:2304, "
                        "sliding_window:16:32, draft:64")
    p.add_argument("--eagle", default="off", help="EAGLE/MTP lookup mode: off | drop | lossless (default off)")
    p.add_argument("--draft-groups", default=None, metavar="I,J",
                   help="indices of groups annotated as draft groups (omitted: none annotated)")
    p.add_argument("--drop-rule", default="lookahead",
                   help="how a dropping group proves the successor token: lookahead (default: the block starting "
                        "at L is cached, as current vLLM) | alignment (older engines: it must serve L + A)")
    p.add_argument("--retention", default="latest",
                   help="latest | dense | N (a multiple of the alignment) | value:BYTES (placement by expected "
                        "value; with one prompt and its resend nothing is learned yet, so it keeps what latest does)")
    p.add_argument("--checkpoint-grid", default="mamba",
                   help="where Mamba states sit: mamba (each Mamba group's block: older engines, default) | "
                        "attention (the KV block, as vLLM 0.33; the Mamba block only bounds the spacing)")
    p.add_argument("--prompt-len", required=True, help="cold prompt length in tokens")
    p.add_argument("--resend-len", default=None, help="resend length (default: = prompt len; larger extends it)")
    p.add_argument("--num-spec-tokens", default=None, help="draft tokens per step (default 3 with EAGLE, else 0)")
    p.add_argument("--no-eagle-aware-retention", action="store_true",
                   help="reproduce the pre-fix retention (no snapshot one alignment unit below boundaries)")
    p.add_argument("--cache-salt", default=None, help="tenant salt folded into the root hash")
    p.add_argument("--verbose", action="store_true", help="explain why each group stopped where it did")
    return p


def _positive_int(name: str, text: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be an integer, got {text!r}") from None
    if value < minimum:
        raise UsageError(f"{name} must be >= {minimum}, got {value}")
    return value


def parse_scenario(argv: list[str]) -> tuple[Scenario, bool]:
    args = build_parser().parse_args(argv)
    if not args.group:
        raise UsageError("at least one --group KIND:BLOCK[:WINDOW] is required")
    groups = tuple(parse_group_spec(text) for text in args.group)
    layout = CacheLayout(groups)
    try:
        eagle = EagleMode(args.eagle.strip().lower())
    except ValueError:
        raise UsageError(f"--eagle must be off, drop or lossless, got {args.eagle!r}") from None
    draft: frozenset[int] = frozenset()
    if args.draft_groups is not None and args.draft_groups.strip():
        items = [s.strip() for s in args.draft_groups.split(",")]
        draft = frozenset(_positive_int("--draft-groups index", s, minimum=0) for s in items)
        bad = sorted(i for i in draft if i >= len(groups))
        if bad:
            raise UsageError(f"--draft-groups index {bad[0]} out of range: there are {len(groups)} groups")
    prompt_len = _positive_int("--prompt-len", args.prompt_len)
    resend_len = prompt_len if args.resend_len is None else _positive_int("--resend-len", args.resend_len)
    default_k = 0 if eagle is EagleMode.OFF else 3
    k = default_k if args.num_spec_tokens is None else _positive_int("--num-spec-tokens", args.num_spec_tokens, 0)
    if eagle is not EagleMode.OFF and k == 0:
        raise UsageError(f"--eagle {eagle.value} needs --num-spec-tokens > 0 (speculation off means --eagle off)")
    if eagle is EagleMode.OFF and k > 0:
        raise UsageError("--num-spec-tokens > 0 needs --eagle drop or lossless")
    try:
        drop_rule = DropRule(args.drop_rule.strip().lower())
    except ValueError:
        raise UsageError(f"--drop-rule must be lookahead or alignment, got {args.drop_rule!r}") from None
    try:
        layout, spacing = on_grid(layout, args.checkpoint_grid)
    except SpecError as exc:
        raise UsageError(f"--checkpoint-grid: {exc}") from None
    make_retention(args.retention, layout.alignment, state_bytes_of(layout), spacing=spacing)  # validate early
    scenario = Scenario(
        groups=groups, prompt_len=prompt_len, resend_len=resend_len, eagle=eagle, draft_groups=draft,
        drop_rule=drop_rule,
        retention=args.retention, num_spec_tokens=k, eagle_aware_retention=not args.no_eagle_aware_retention,
        cache_salt=args.cache_salt, checkpoint_grid=args.checkpoint_grid.strip().lower(),
    )
    return scenario, args.verbose


def explain(scenario: Scenario, verbose: bool = False) -> dict:
    result = simulate(scenario, explain=verbose)
    layout, coord = scenario.layout, result.coordinator
    resend = result.resend
    profile = cache_profile(coord, make_retention(scenario.retention, layout.alignment, state_bytes_of(layout),
                                                  spacing=scenario.spacing))
    out = {
        "groups": layout.describe(),
        "alignment": layout.alignment,
        "hash_block_size": layout.hash_block_size,
        "eagle": scenario.eagle.value,
        "num_spec_tokens": scenario.num_spec_tokens,
        "annotated_groups": sorted(coord.annotated_groups),
        "dropping_groups": sorted(coord.dropping_groups),
        "drop_rule": coord.drop_rule.value,
        "retention": scenario.retention,
        "checkpoint_grid": scenario.checkpoint_grid,
        "eagle_aware_retention": scenario.eagle_aware_retention,
        "prompt_len": scenario.prompt_len,
        "resend_len": resend.num_prompt_tokens,
        "cold": {"hit_tokens": result.cold.hit.hit_tokens, "checkpoints": list(result.cold.checkpoints),
                 "num_computed_prompt_tokens": scenario.prompt_len - result.cold.hit.hit_tokens},
        "per_group_hits": list(resend.hit.per_group_hits),
        "hit_tokens": resend.hit.hit_tokens,
        # the resend's prompt tokens served from cache vs run through the model's forward (the engine
        # reports the same pair per request: num_cached_tokens / num_computed_prompt_tokens)
        "num_cached_tokens": resend.hit.hit_tokens,
        "num_computed_prompt_tokens": resend.num_prompt_tokens - resend.hit.hit_tokens,
        "num_recomputed_tokens": resend.num_prompt_tokens - resend.hit.hit_tokens,
        "shortest_hit_prompt": profile.shortest_hit_prompt,
        "needs": list(profile.needs),
        "reason": resend.report.reason,
        "reason_position": resend.report.reason_position,
    }
    if verbose:
        out["explanation"] = resend.explanation + _reason_lines(resend.report, layout.alignment)
        hit = resend.hit.hit_tokens
        if coord.any_group_drops and coord.drop_rule is DropRule.LOOKAHEAD and hit:
            # the block each dropping group needed cached to prove the successor token at the hit
            out["lookahead_blocks"] = {
                str(g): [hit, coord.serving_extent(g, hit)] for g in sorted(coord.dropping_groups)
            }
    return out


def _reason_lines(report: LookupReport, alignment: int) -> list[str]:
    if report.reason is None:
        return []
    return [f"reason: {report.reason}: {describe_reason(report.reason, report.reason_position, alignment)}"]


def explain_lookup(profile: CacheProfile, report: LookupReport) -> dict:
    """What `explain` says of one lookup a server did (a served request's `LookupReport`, taken
    at its admission): the same keys, built from the report alone (the cache has moved on)."""
    hit = report.hit_tokens
    lines = [f"group {g} ({name}): {own}" for g, (name, own) in enumerate(zip(profile.groups, report.per_group_hits))]
    lines.append(f"cached prefix {report.shared_prefix_tokens} tokens; attention alone would land at "
                 f"{report.attention_match_tokens}")
    lines.append(f"reconciliation: candidates {' -> '.join(map(str, report.candidates))}; hit {hit}")
    lines += _reason_lines(report, profile.alignment)
    promoted = list(report.host_promoted_pages) or [0] * len(report.per_group_hits)
    if any(promoted):
        lines.append("served through the host tier: pages copied back per group " + ", ".join(map(str, promoted)))
    return {
        **profile.as_dict(),
        "num_prompt_tokens": report.num_prompt_tokens,
        "per_group_hits": list(report.per_group_hits),
        "hit_tokens": hit,
        "num_cached_tokens": hit,
        "hit_tier": "host" if any(promoted) else "device" if hit else None,
        "host_promoted_pages": promoted,
        "num_computed_prompt_tokens": report.num_prompt_tokens - hit,
        "attention_match_tokens": report.attention_match_tokens,
        "shared_prefix_tokens": report.shared_prefix_tokens,
        "candidates": list(report.candidates),
        "reason": report.reason,
        "reason_position": report.reason_position,
        "explanation": lines,
    }


def main(argv: list[str] | None = None) -> int:
    try:
        scenario, verbose = parse_scenario(list(sys.argv[1:] if argv is None else argv))
    except (UsageError, SpecError) as exc:
        print(f"hybridserve explain: error: {exc}", file=sys.stderr)
        return 2
    report = explain(scenario, verbose)
    if verbose:
        for line in report["explanation"]:
            print(line, file=sys.stderr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
