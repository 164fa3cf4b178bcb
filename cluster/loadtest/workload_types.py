"""The plain data of a load-test workload (`workloads.py` builds them): its config, one request's
spec, the ordered workload, and the text every prompt is made of. Its own module so that each
workload's builder (`interference_workload.py`, ...) and `workloads.build_workload` import it, not
each other."""

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
