"""`hybridserve gen-trace`: seeded multi-turn traces in the Mooncake format, for the simulator and
`hybridserve loadtest trace`.

The shipped Mooncake trace shares prefixes between independent requests; what hybrid caches live on
is conversations, where each turn's prompt is the previous turn's prompt *and output* plus a new
message, so a turn can hit the Mamba state the previous turn left at its final boundary. The
workloads follow the shape of Marconi's generator (MLSys 2025):

    chat    LMSys-style sessions: a system prompt from a branching tree (a few base prompts, each
            with variants that extend it), 1-16 turns (geometric, mean 4), user messages and replies
            of lognormal length, tens of seconds between turns
    agent   SWE-bench-style loops: one tool-spec system prompt shared by every agent, a task of its
            own, 10-40 steps of (short action, long tool observation), seconds between steps
    mixed   both, sessions interleaved

Sessions arrive as a Poisson process. A 512-token block's id is determined by everything before
and in it (its parent block and the content pieces it holds), so equal ids mean an equal prefix: a
turn's full blocks reuse the previous turn's ids, and a block the new text extends gets a new id.
Extra keys per line (`session`, `turn`, `workload`) are ignored by the Mooncake reader.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cache_service.trace_sim.trace import TRACE_BLOCK_TOKENS

WORKLOADS = ("chat", "agent", "mixed")


@dataclass(frozen=True)
class ChatShape:
    num_base_prompts: int = 4
    num_variants: int = 3  # per base prompt: the branches of the system-prompt tree
    base_prompt_tokens: tuple[int, int] = (1000, 3000)  # uniform range
    variant_tokens: tuple[int, int] = (200, 800)
    mean_turns: float = 4.0
    max_turns: int = 16
    user_tokens_median: int = 80
    output_tokens_median: int = 200
    length_sigma: float = 0.8  # lognormal spread of message lengths
    think_time_s: float = 20.0  # mean gap between a reply and the next turn


@dataclass(frozen=True)
class AgentShape:
    tool_prompt_tokens: int = 2500  # shared by every agent session
    task_tokens: tuple[int, int] = (800, 2500)
    steps: tuple[int, int] = (10, 40)
    action_tokens_median: int = 150
    observation_tokens_median: int = 900
    length_sigma: float = 0.7
    step_gap_s: float = 4.0
    max_context_tokens: int = 64_000  # a session stops when its next prompt would pass this


@dataclass(frozen=True)
class GenConfig:
    workload: str = "mixed"
    num_sessions: int = 200
    session_rate: float = 0.5  # new sessions per second
    seed: int = 0
    chat: ChatShape = ChatShape()
    agent: AgentShape = AgentShape()

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.num_sessions < 1 or not self.session_rate > 0:
            raise ValueError("sessions must be >= 1 and the session rate > 0")


class BlockIds:
    """Ids for 512-token blocks of content sequences, equal exactly when the prefix is equal."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def of(self, segments: list[tuple[int, int]]) -> list[int]:
        """`segments`: (segment id, length) pairs in order; one id per (possibly partial) block."""
        ids: list[int] = []
        pieces: list[tuple[int, int, int]] = []  # (segment, start, end) inside the current block
        room, parent = TRACE_BLOCK_TOKENS, -1
        for seg, length in segments:
            start = 0
            while start < length:
                take = min(room, length - start)
                pieces.append((seg, start, start + take))
                start += take
                room -= take
                if room == 0:
                    parent = self._id(parent, pieces)
                    ids.append(parent)
                    pieces, room = [], TRACE_BLOCK_TOKENS
        if pieces:
            ids.append(self._id(parent, pieces))
        return ids

    def _id(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(pieces)), len(self._ids))


@dataclass
class _Turn:
    arrival_s: float
    segments: list[tuple[int, int]]
    output_tokens: int
    session: int
    turn: int
    workload: str


class _Sessions:
    def __init__(self, config: GenConfig) -> None:
        self.config, self.rng = config, random.Random(config.seed)
        self._next_segment = 0
        chat = config.chat
        self.bases = [self._segment(self.rng.randint(*chat.base_prompt_tokens)) for _ in range(chat.num_base_prompts)]
        self.variants = [[self._segment(self.rng.randint(*chat.variant_tokens)) for _ in range(chat.num_variants)]
                         for _ in self.bases]
        self.tool_prompt = self._segment(config.agent.tool_prompt_tokens)

    def _segment(self, length: int) -> tuple[int, int]:
        self._next_segment += 1
        return (self._next_segment, max(1, length))

    def _lognormal(self, median: int, sigma: float) -> int:
        return max(1, round(median * math.exp(self.rng.gauss(0.0, sigma))))

    def chat(self, session: int, start_s: float) -> Iterator[_Turn]:
        c = self.config.chat
        base = min(int(self.rng.paretovariate(1.2)) - 1, len(self.bases) - 1)  # popular bases first
        context = [self.bases[base], self.rng.choice(self.variants[base])]
        turns = min(c.max_turns, 1 + int(math.log(1 - self.rng.random()) / math.log(1 - 1 / c.mean_turns)))
        t = start_s
        for turn in range(turns):
            context = [*context, self._segment(self._lognormal(c.user_tokens_median, c.length_sigma))]
            out = self._lognormal(c.output_tokens_median, c.length_sigma)
            yield _Turn(t, context, out, session, turn, "chat")
            context = [*context, self._segment(out)]
            t += self.rng.expovariate(1 / c.think_time_s)

    def agent(self, session: int, start_s: float) -> Iterator[_Turn]:
        a = self.config.agent
        context = [self.tool_prompt, self._segment(self.rng.randint(*a.task_tokens))]
        t = start_s
        for step in range(self.rng.randint(*a.steps)):
            out = self._lognormal(a.action_tokens_median, a.length_sigma)
            if sum(n for _, n in context) + out > a.max_context_tokens:
                return
            yield _Turn(t, context, out, session, step, "agent")
            context = [*context, self._segment(out),
                       self._segment(self._lognormal(a.observation_tokens_median, a.length_sigma))]
            t += self.rng.expovariate(1 / a.step_gap_s)


def generate(config: GenConfig) -> list[dict]:
    """The trace's records, by arrival (ties keep session order)."""
    sessions = _Sessions(config)
    turns: list[_Turn] = []
    t = 0.0
    for s in range(config.num_sessions):
        kind = config.workload if config.workload != "mixed" else ("chat", "agent")[s % 2]
        turns.extend(sessions.chat(s, t) if kind == "chat" else sessions.agent(s, t))
        t += sessions.rng.expovariate(config.session_rate)
    turns.sort(key=lambda x: (x.arrival_s, x.session, x.turn))
    ids = BlockIds()
    return [{"timestamp": round(x.arrival_s * 1000), "input_length": sum(n for _, n in x.segments),
             "output_length": x.output_tokens, "hash_ids": ids.of(x.segments), "session": x.session,
             "turn": x.turn, "workload": x.workload} for x in turns]


def write_trace(records: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridserve gen-trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mixed", choices=WORKLOADS)
    p.add_argument("--sessions", type=int, default=GenConfig.num_sessions)
    p.add_argument("--session-rate", type=float, default=GenConfig.session_rate, help="new sessions per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/traces/conversations.jsonl.gz", help="Mooncake JSONL (.gz compresses)")
    args = p.parse_args(argv)
    try:
        config = GenConfig(args.workload, args.sessions, args.session_rate, args.seed)
    except ValueError as exc:
        p.error(str(exc))
    records = generate(config)
    path = write_trace(records, args.out)
    tokens = sum(r["input_length"] for r in records)
    print(f"{path}: {len(records)} requests in {config.num_sessions} sessions, {tokens:,} prompt tokens, "
          f"{records[-1]['timestamp'] / 1000:.0f} s")
    return 0
