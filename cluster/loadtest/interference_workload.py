"""The `interference` workload: decoding streams with and without long prompts arriving beside them.

    warmup        d0 d1 .. d{S-1}            S streams: a short prompt, `decode_tokens` out each
                                             (not reported: a fresh server's first steps are slow)
    control       d0 d1 .. d{S-1}            S streams again, after every warmup one
    interference  d0 d1 .. d{S-1}            S streams again, after every control one
                  + L0 L1 .. L{L-1}          long prompts (`prompt_len`), `long_gap_s` apart,
                                             the first `long_gap_s` after the round starts

The streams' inter-token latency in the two rounds is what prefill/decode disaggregation is for:
on a mixed replica a long prefill shares steps with the decodes beside it (their ITL jumps); on a
`cluster.pd` cluster the long prompts prefill on the prefill replicas while the decode replicas
keep decoding. Streams are `source="decode"`, `phase` control | interference; long prompts are
`source="long"`, `phase="cold"` (their TTFT is the cold TTFT of the ordinary table).
"""

from __future__ import annotations

import random

from cluster.loadtest.workload_types import RequestSpec, WorkloadConfig, make_text_tokens


def build_interference(config: WorkloadConfig) -> list[RequestSpec]:
    rng = random.Random(f"{config.seed}:interference")
    salt = f"{config.salt}interference" if config.salt else None
    num_streams = config.streams
    specs: list[RequestSpec] = []
    barrier: tuple[int, ...] = ()
    for turn, phase in enumerate(("warmup", "control", "interference")):
        first = len(specs)
        for s in range(num_streams):  # fresh prompts each round: a round hits nothing an earlier one left
            specs.append(RequestSpec(first + s, "decode", phase, f"d{s}", turn,
                                     make_text_tokens(rng, config.question_len), config.decode_tokens, salt,
                                     after=barrier))
        if phase != "interference":
            barrier = tuple(range(first, first + num_streams))
    for k in range(config.long_prompts):
        specs.append(RequestSpec(len(specs), "long", "cold", f"l{k}", 2, make_text_tokens(rng, config.prompt_len),
                                 config.max_tokens, salt, after=barrier,
                                 delay_s=round((k + 1) * config.long_gap_s, 6)))
    return specs
