"""The probes of `bench.faults`' kill scenarios: three requests forced onto the replica about to be
killed, each past its first token before the kill (a long greedy one that must finish with its cold
output, a seeded sampled one that must finish, and an unseeded sampled one, the one documented case
that may end with a retryable error because its streamed tokens cannot be regenerated)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.fault_env import Env, ScenarioResult

PROBE_TOKENS = 160  # long enough that a probe is still streaming when its replica is killed


@dataclass
class Probe:
    """A request forced onto a replica about to be killed, started before the kill."""

    kind: str  # greedy | seeded | unseeded
    stream: object  # RequestStream
    expect: list[int] | None  # greedy: the cold output
    first: object = None  # its first output (read before the kill)


def probe_params(kind: str):
    from workers.engine.sampling_params import SamplingParams

    sampled = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0, "seed": 7},
               "unseeded": {"temperature": 1.0}}[kind]
    return SamplingParams(max_tokens=PROBE_TOKENS, ignore_eos=True, **sampled)


def probe_reference(env: Env, salt: str) -> list[int]:
    """The greedy probe's cold output (before the traffic: its own salt, so nothing hits)."""
    return list(env.backend.generate(env.prompts[0], probe_params("greedy"), cache_salt=f"{salt}probe-cold")[0]
                .token_ids)


def start_probes(env: Env, victim: str, salt: str, expect: list[int]) -> list[Probe]:
    """A greedy, a seeded and an unseeded sampled request on `victim`, each past its first token."""
    probes = []
    for kind in ("greedy", "seeded", "unseeded"):
        stream = env.backend.submit(env.prompts[0], probe_params(kind), cache_salt=f"{salt}probe-{kind}",
                                    replica_id=victim)
        probes.append(Probe(kind, stream, expect if kind == "greedy" else None))
    for probe in probes:  # each has streamed (the first output carries a token) before the kill
        probe.first = probe.stream.get(timeout=120)
    return probes


def finish_probes(result: ScenarioResult, probes: list[Probe]) -> None:
    """Score the probes: greedy and seeded must finish (greedy with its cold output); the unseeded
    one is the documented case when it ends with the "cannot resume" retryable error."""
    from workers.engine.errors import ServerOverloadedError
    from workers.engine.request import RequestOutput

    for probe in probes:
        result.sent += 1
        first = probe.first
        try:
            if not isinstance(first, RequestOutput):  # a StreamEnd before any token
                raise first.error or RuntimeError("aborted before its first token")
            tokens = list(first.new_token_ids)
            if not first.finished:
                tokens += [t for out in probe.stream for t in out.new_token_ids]
        except ServerOverloadedError as exc:
            if probe.kind == "unseeded" and "cannot resume" in str(exc):
                result.retryable_errors += 1
                result.documented_retryable += 1
                result.details.setdefault("retryable_why", []).append(
                    f"unseeded sampled request had streamed {len(first.token_ids)} token(s): {exc}")
            else:
                result.lost += 1
                result.details.setdefault("errors", []).append(f"{probe.kind} probe: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - scored as lost
            result.lost += 1
            result.details.setdefault("errors", []).append(f"{probe.kind} probe: {type(exc).__name__}: {exc}")
            continue
        result.completed += 1
        result.details.setdefault("probes_completed", []).append(probe.kind)
        if probe.expect is not None:
            result.differing += tokens != probe.expect
