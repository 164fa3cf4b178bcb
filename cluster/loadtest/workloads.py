"""Seeded, reproducible workloads: a `Workload` is an ordered list of `RequestSpec`s.

Every spec says which earlier requests it waits for (`after`) and, for chat, whose prompt +
response it extends (`extends`). The client resolves those at run time, so a workload is plain
data: the same `WorkloadConfig` always builds the same prompts.

    resend   P1 P2 .. Pn (cold)            then P1 P2 .. Pn again (warm, after every cold one)
    chat     S1: T0 -> T1 -> T2 ..         each turn = previous prompt + response + a new message
    tenants  tenant t: sys_t+q0 (cold)     then sys_t+q1, sys_t+q2 .. (warm, after every cold one:
                                           the system prompt ends at a shared-prefix junction)
    mixed    the three above, interleaved, arriving at `rate` requests/s
    interference  decoding streams alone, then again with long prompts arriving (interference_workload.py)
    trace    a slice of a Mooncake trace at its own (scaled) arrival times (trace_workload.py)
"""

from __future__ import annotations

import dataclasses
import random

from cluster.loadtest.interference_workload import build_interference
from cluster.loadtest.workload_types import (  # noqa: F401 - re-exported: the load test's names
    MIXED_DEFAULT_RATE,
    WORKLOADS,
    RequestSpec,
    Workload,
    WorkloadConfig,
    make_text_tokens,
)


def _rng(config: WorkloadConfig, part: str) -> random.Random:
    return random.Random(f"{config.seed}:{part}")


def _salt(config: WorkloadConfig, name: str) -> str | None:
    return f"{config.salt}{name}" if config.salt else None


def build_resend(config: WorkloadConfig) -> list[RequestSpec]:
    rng = _rng(config, "resend")
    prompts = [make_text_tokens(rng, config.prompt_len) for _ in range(config.num_prompts)]
    salt = _salt(config, "resend")
    n = config.num_prompts
    cold = [RequestSpec(i, "resend", "cold", f"p{i}", 0, p, config.max_tokens, salt)
            for i, p in enumerate(prompts)]
    barrier = tuple(range(n))  # warm TTFT is measured without cold prefills running beside it
    warm = [RequestSpec(n + i, "resend", "warm", f"p{i}", 1, p, config.max_tokens, salt, after=barrier)
            for i, p in enumerate(prompts)]
    return cold + warm


def build_chat(config: WorkloadConfig) -> list[RequestSpec]:
    rng = _rng(config, "chat")
    salt = _salt(config, "chat")
    specs: list[RequestSpec] = []
    for turn in range(config.turns):  # turn-major, so sessions run side by side
        for s in range(config.sessions):
            index = len(specs)
            if turn == 0:
                specs.append(RequestSpec(index, "chat", "cold", f"s{s}", 0,
                                         make_text_tokens(rng, config.prompt_len), config.max_tokens, salt))
            else:
                prev = index - config.sessions
                specs.append(RequestSpec(index, "chat", "warm", f"s{s}", turn,
                                         make_text_tokens(rng, config.question_len), config.max_tokens, salt,
                                         after=(prev,), extends=prev))
    return specs


def build_tenants(config: WorkloadConfig) -> list[RequestSpec]:
    rng = _rng(config, "tenants")
    systems = [make_text_tokens(rng, config.prompt_len) for _ in range(config.tenants)]
    specs: list[RequestSpec] = []
    for q in range(config.questions_per_tenant):  # question-major: every tenant's cold request goes first
        for t, system in enumerate(systems):
            index = len(specs)
            question = make_text_tokens(rng, config.question_len)
            specs.append(RequestSpec(index, "tenants", "cold" if q == 0 else "warm", f"t{t}", q,
                                     system + question, config.max_tokens, _salt(config, f"tenant-{t}"),
                                     after=() if q == 0 else tuple(range(config.tenants))))
    return specs


def _interleave(parts: list[list[RequestSpec]]) -> list[RequestSpec]:
    """Round-robin over the parts, keeping each part's order (so `after` always points back), renumbered."""
    order: list[tuple[int, RequestSpec]] = []
    queues = [list(p) for p in parts]
    while any(queues):
        for k, q in enumerate(queues):
            if q:
                order.append((k, q.pop(0)))
    new = {(k, s.index): i for i, (k, s) in enumerate(order)}
    return [dataclasses.replace(s, index=i, after=tuple(new[k, a] for a in s.after),
                                extends=None if s.extends is None else new[k, s.extends])
            for i, (k, s) in enumerate(order)]


def _with_arrivals(specs: list[RequestSpec], rate: float, rng: random.Random) -> list[RequestSpec]:
    t, out = 0.0, []
    for s in specs:
        out.append(dataclasses.replace(s, arrival_s=round(t, 6)))
        t += rng.expovariate(rate)
    return out


def build_trace(config: WorkloadConfig) -> list[RequestSpec]:
    from cluster.loadtest.trace_workload import trace_prompts, trace_slice

    requests = trace_slice(config.trace, config.trace_start, config.trace_limit, config.scale, config.time_scale,
                           config.max_model_len - config.max_tokens)
    salt = _salt(config, "trace")
    seen: set[int] = set()
    specs = []
    for req, prompt in zip(requests, trace_prompts(requests, config.seed)):
        first = req.hash_ids[0]
        specs.append(RequestSpec(req.index, "trace", "warm" if first in seen else "cold", f"b{first}", 0, prompt,
                                 max(1, min(req.output_length, config.max_tokens)), salt,
                                 arrival_s=round(req.arrival_s, 6)))
        seen.add(first)
    return specs


def build_workload(config: WorkloadConfig) -> Workload:
    """The workload named by `config.workload`; identical configs give identical workloads."""
    if config.workload == "trace":
        return Workload("trace", tuple(build_trace(config)))
    if config.workload == "interference":
        return Workload("interference", tuple(build_interference(config)), config.streams + config.long_prompts)
    if config.workload == "mixed":
        specs = _interleave([build_resend(config), build_chat(config), build_tenants(config)])
    else:
        specs = {"resend": build_resend, "chat": build_chat, "tenants": build_tenants}[config.workload](config)
    rate = config.rate if config.rate is not None or config.workload != "mixed" else MIXED_DEFAULT_RATE
    if rate is not None:
        specs = _with_arrivals(specs, rate, _rng(config, "arrivals"))
    return Workload(config.workload, tuple(specs))
