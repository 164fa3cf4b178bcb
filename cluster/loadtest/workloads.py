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
from dataclasses import dataclass

from workers.train.byte_tokenizer import encode

WORKLOADS = ("resend", "chat", "tenants", "mixed", "trace", "interference")
MIXED_DEFAULT_RATE = 4.0  # requests/s when `mixed` is run without a rate

_WORDS = (
    "def", "return", "self", "import", "class", "for", "in", "if", "else", "elif", "while", "value", "items",
    "result", "data", "None", "True", "False", "len", "range", "print", "key", "list", "dict", "args", "kwargs",
    "lambda", "yield", "with", "open", "path", "name", "index", "count", "buffer", "token", "cache", "block",
    "state", "request", "prefix", "hash", "node", "size", "offset", "config", "error", "raise", "try", "except",
)
_OPS = (" = ", " + ", " - ", "(", ")", ", ", ".", "[", "]", ": ", " == ", " and ", " or ", " not ")


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes of one workload; `seed` fixes every prompt. Token counts are byte-tokenizer ids."""

    workload: str = "resend"
    num_prompts: int = 8  # resend: distinct prompts (each sent twice)
    prompt_len: int = 1536  # resend prompt, chat first turn, tenant system prompt
    question_len: int = 96  # tenant question and each later chat message
    max_tokens: int = 8
    concurrency: int = 4
    sessions: int = 3  # chat sessions
    turns: int = 3  # chat turns per session (first one cold)
    tenants: int = 3
    questions_per_tenant: int = 4  # first one cold
    rate: float | None = None  # requests/s (Poisson arrivals); None: closed loop (mixed: 4/s)
    seed: int = 0
    salt: str | None = None  # prefix of every cache_salt; None: a fresh one per run (cold stays cold); "": none
    timeout_s: float = 120.0
    trace: str | None = None  # trace: the Mooncake file, slice, scales (see trace_workload.py)
    trace_start: int = 0
    trace_limit: int = 64
    scale: float = 1.0 / 16
    time_scale: float = 1.0
    max_model_len: int = 2048
    streams: int = 4  # interference: decoding streams per round (prompt: question_len tokens)
    decode_tokens: int = 64  # interference: output tokens of each stream
    long_prompts: int = 4  # interference: long prompts (prompt_len tokens, max_tokens out) in the second round
    long_gap_s: float = 0.5  # interference: seconds between long-prompt arrivals (and before the first)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        for name in ("num_prompts", "prompt_len", "question_len", "max_tokens", "concurrency", "sessions", "turns",
                     "tenants", "questions_per_tenant", "streams", "decode_tokens", "long_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_gap_s < 0:
            raise ValueError(f"long_gap_s must be >= 0 s, got {self.long_gap_s}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.workload == "trace" and not self.trace:
            raise ValueError("the trace workload needs --trace FILE "
                             "(e.g. bench/traces/mooncake_synthetic_trace.jsonl.gz)")
        if self.max_model_len <= self.max_tokens + 1:
            raise ValueError(f"max_model_len {self.max_model_len} leaves no room for a prompt and "
                             f"{self.max_tokens} output tokens")

    def replace(self, **changes) -> WorkloadConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RequestSpec:
    """One request. `prompt` is the full prompt, or for chat the new message appended after `extends`."""

    index: int
    source: str  # resend | chat | tenants (the mixed workload keeps its parts' names)
    phase: str  # cold | warm
    group: str  # prompt / session / tenant id
    turn: int
    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    after: tuple[int, ...] = ()
    extends: int | None = None
    arrival_s: float | None = None  # offset from the run's start (open loop only)
    delay_s: float | None = None  # sent this long after its `after` requests finished (interference)


@dataclass(frozen=True)
class Workload:
    name: str
    specs: tuple[RequestSpec, ...]
    min_concurrency: int = 1  # the client sends at least this many at once (interference: every request of a round)

    def __post_init__(self) -> None:
        assert all(s.index == i for i, s in enumerate(self.specs)), "specs[i].index must be i"

    @property
    def num_requests(self) -> int:
        return len(self.specs)


def make_text_tokens(rng: random.Random, num_tokens: int) -> tuple[int, ...]:
    """Python-looking text, byte-tokenized, exactly `num_tokens` ids (all in 3..258)."""
    out: list[int] = []
    while len(out) < num_tokens:
        words = [rng.choice(_WORDS) + rng.choice(_OPS) for _ in range(rng.randrange(3, 9))]
        out += encode(" " * 4 * rng.randrange(3) + "".join(words).rstrip() + "\n")
    return tuple(out[:num_tokens])


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
        from cluster.loadtest.interference_workload import build_interference

        return Workload("interference", tuple(build_interference(config)), config.streams + config.long_prompts)
    if config.workload == "mixed":
        specs = _interleave([build_resend(config), build_chat(config), build_tenants(config)])
    else:
        specs = {"resend": build_resend, "chat": build_chat, "tenants": build_tenants}[config.workload](config)
    rate = config.rate if config.rate is not None or config.workload != "mixed" else MIXED_DEFAULT_RATE
    if rate is not None:
        specs = _with_arrivals(specs, rate, _rng(config, "arrivals"))
    return Workload(config.workload, tuple(specs))
