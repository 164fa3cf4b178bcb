"""`explain --verbose`'s per-group reasons, word for word, for each probe kind and each branch
(hit / no hit, stopped by a missing block / by the prompt's end, more than six snapshots, the
lookahead block missing / past the prompt, the alignment rule). The numbers by hand: a cold
request of P tokens with dense retention leaves full blocks over its hashed tokens (P rounded
down to the block) and Mamba snapshots at every multiple of the Mamba block up to
R = floor((P - 1) / A) * A; the resend is capped at the hashed tokens below P. Written to kill
mutants `make mutants` found surviving (the reasons are what a user reads to see why a hit failed)."""

from __future__ import annotations

import pytest

from cache_service.coordinator import EagleMode
from cache_service.hit_finders import DropRule
from cache_service.simulate import simulate
from tests.cache_service.helpers import make_scenario

FULL_MAMBA = ["full:16", "mamba:64"]
DROP32 = ["full:32", "mamba:32"]
COLD_MAMBA = "no state snapshot at any aligned length <= the limit; snapshots held: [none]"


def reasons(groups, prompt_len, **kw) -> tuple[list[str], list[str]]:
    result = simulate(make_scenario(groups, prompt_len, retention="dense", **kw), explain=True)
    return result.cold.explanation, result.resend.explanation


@pytest.mark.parametrize("groups, prompt_len, kw, cold, resend", [
    (FULL_MAMBA, 300, {}, [
        "group 0 (full:16): 0 -- 0 contiguous blocks cached (0 tokens), stopped by block 0 (tokens 0..16) not "
        "cached; capped at 288 (the prompt's full blocks) and aligned to 0",
        f"group 1 (mamba:64): 0 -- {COLD_MAMBA}",
        "reconciliation: candidates 256 -> 0; hit 0",
    ], [
        "group 0 (full:16): 256 -- 18 contiguous blocks cached (288 tokens), stopped by the prompt's last full "
        "block; capped at 288 (the prompt's full blocks) and aligned to 256",
        "group 1 (mamba:64): 256 -- state snapshot at 256; snapshots held at <= cap: [64, 128, 192, 256]",
        "reconciliation: candidates 256; hit 256",
    ]),
    (FULL_MAMBA, 300, {"resend_len": 1000}, None, [  # the resend runs past what the cold request left
        "group 0 (full:16): 256 -- 18 contiguous blocks cached (288 tokens), stopped by block 18 (tokens "
        "288..304) not cached; capped at 992 (the prompt's full blocks) and aligned to 256",
        "group 1 (mamba:64): 256 -- state snapshot at 256; snapshots held at <= cap: [64, 128, 192, 256]",
        "reconciliation: candidates 960 -> 256; hit 256",
    ]),
    (FULL_MAMBA, 300, {"resend_len": 304}, None, [  # block 18 ends exactly at the hashed end: inside
        "group 0 (full:16): 256 -- 18 contiguous blocks cached (288 tokens), stopped by block 18 (tokens "
        "288..304) not cached; capped at 303 (num_prompt_tokens - 1) and aligned to 256",
        "group 1 (mamba:64): 256 -- state snapshot at 256; snapshots held at <= cap: [64, 128, 192, 256]",
        "reconciliation: candidates 256; hit 256",
    ]),
    (FULL_MAMBA, 64, {}, None, [  # a snapshot at 64 (the final boundary) lies past the cap of 63: not listed
        "group 0 (full:16): 0 -- 4 contiguous blocks cached (64 tokens), stopped by the prompt's last full "
        "block; capped at 63 (num_prompt_tokens - 1) and aligned to 0",
        f"group 1 (mamba:64): 0 -- {COLD_MAMBA}",
        "reconciliation: candidates 0; hit 0",
    ]),
    (FULL_MAMBA, 400, {}, None, [  # exactly six snapshots: all shown, no count
        "group 0 (full:16): 384 -- 25 contiguous blocks cached (400 tokens), stopped by the prompt's last full "
        "block; capped at 399 (num_prompt_tokens - 1) and aligned to 384",
        "group 1 (mamba:64): 384 -- state snapshot at 384; snapshots held at <= cap: [64, 128, 192, 256, 320, "
        "384]",
        "reconciliation: candidates 384; hit 384",
    ]),
    (FULL_MAMBA, 460, {}, None, [  # seven: the last six and the count
        "group 0 (full:16): 448 -- 28 contiguous blocks cached (448 tokens), stopped by the prompt's last full "
        "block; capped at 448 (the prompt's full blocks) and aligned to 448",
        "group 1 (mamba:64): 448 -- state snapshot at 448; snapshots held at <= cap: [128, 192, 256, 320, 384, "
        "448] (7 in all)",
        "reconciliation: candidates 448; hit 448",
    ]),
    (FULL_MAMBA, 1000, {}, None, [  # 15 snapshots (64..960): the last six shown
        "group 0 (full:16): 960 -- 62 contiguous blocks cached (992 tokens), stopped by the prompt's last full "
        "block; capped at 992 (the prompt's full blocks) and aligned to 960",
        "group 1 (mamba:64): 960 -- state snapshot at 960; snapshots held at <= cap: [640, 704, 768, 832, 896, "
        "960] (15 in all)",
        "reconciliation: candidates 960; hit 960",
    ]),
    (["sliding_window:16:128", "mamba:64"], 300, {}, [
        "group 0 (sliding_window:16:128): 0 -- no cached window tail (last 127 tokens) before any aligned "
        "length <= 256",
        f"group 1 (mamba:64): 0 -- {COLD_MAMBA}",
        "reconciliation: candidates 256 -> 0; hit 0",
    ], [
        "group 0 (sliding_window:16:128): 256 -- window tail before 256 cached; 256 is the aligned request cap",
        "group 1 (mamba:64): 256 -- state snapshot at 256; snapshots held at <= cap: [64, 128, 192, 256]",
        "reconciliation: candidates 256; hit 256",
    ]),
    (["sliding_window:16:128", "mamba:64"], 300, {"resend_len": 1000}, None, [
        "group 0 (sliding_window:16:128): 256 -- no cached window tail (last 127 tokens) before any aligned "
        "length in (256, 960]; the tail before 256 is cached",
        "group 1 (mamba:64): 256 -- state snapshot at 256; snapshots held at <= cap: [64, 128, 192, 256]",
        "reconciliation: candidates 960 -> 256; hit 256",
    ]),
    (DROP32, 127, {"eagle": EagleMode.DROP}, [  # the DESIGN.md regression: 127 tokens, block 32, hit 64
        "group 0 (full:32): 0 -- 0 contiguous blocks cached (0 tokens), stopped by block 0 (tokens 0..32) not "
        "cached; capped at 96 (the prompt's full blocks) and aligned to 0; EAGLE drop (lookahead) needs block "
        "[L, L+32) cached -> 0",
        f"group 1 (mamba:32): 0 -- {COLD_MAMBA}",
        "reconciliation: candidates 96 -> 0; hit 0",
    ], [
        "group 0 (full:32): 64 -- 3 contiguous blocks cached (96 tokens), stopped by the prompt's last full "
        "block; capped at 96 (the prompt's full blocks) and aligned to 96; EAGLE drop (lookahead) needs block "
        "[L, L+32) cached: at 96 the lookahead block [96, 128) runs past the prompt's full blocks (96 tokens); "
        "at 64 lookahead block [64, 96) cached -> 64",
        "group 1 (mamba:32): 96 -- state snapshot at 96; snapshots held at <= cap: [32, 64, 96]",
        "reconciliation: candidates 96 -> 64; hit 64",
    ]),
    (DROP32, 300, {"eagle": EagleMode.DROP, "resend_len": 1000}, None, [
        "group 0 (full:32): 256 -- 9 contiguous blocks cached (288 tokens), stopped by block 9 (tokens 288..320) "
        "not cached; capped at 992 (the prompt's full blocks) and aligned to 288; EAGLE drop (lookahead) needs "
        "block [L, L+32) cached: at 288 the lookahead block [288, 320) is not cached; at 256 lookahead block "
        "[256, 288) cached -> 256",
        "group 1 (mamba:32): 288 -- state snapshot at 288; snapshots held at <= cap: [128, 160, 192, 224, 256, "
        "288] (9 in all)",
        "reconciliation: candidates 992 -> 256; hit 256",
    ]),
    (DROP32, 300, {"eagle": EagleMode.DROP, "resend_len": 330}, None, [  # [288, 320) ends at the hashed end
        "group 0 (full:32): 256 -- 9 contiguous blocks cached (288 tokens), stopped by block 9 (tokens 288..320) "
        "not cached; capped at 320 (the prompt's full blocks) and aligned to 288; EAGLE drop (lookahead) needs "
        "block [L, L+32) cached: at 288 the lookahead block [288, 320) is not cached; at 256 lookahead block "
        "[256, 288) cached -> 256",
        "group 1 (mamba:32): 288 -- state snapshot at 288; snapshots held at <= cap: [128, 160, 192, 224, 256, "
        "288] (9 in all)",
        "reconciliation: candidates 320 -> 256; hit 256",
    ]),
    (["full:32", "mamba:64"], 300, {"eagle": EagleMode.DROP, "drop_rule": DropRule.ALIGNMENT}, [
        "group 0 (full:32): 0 -- 0 contiguous blocks cached (0 tokens), stopped by block 0 (tokens 0..32) not "
        "cached; capped at 288 (the prompt's full blocks) and aligned to 0; EAGLE drop (alignment rule) removes "
        "one alignment unit -> 0",
        f"group 1 (mamba:64): 0 -- {COLD_MAMBA}",
        "reconciliation: candidates 256 -> 0; hit 0",
    ], [
        "group 0 (full:32): 192 -- 9 contiguous blocks cached (288 tokens), stopped by the prompt's last full "
        "block; capped at 288 (the prompt's full blocks) and aligned to 256; EAGLE drop (alignment rule) removes "
        "one alignment unit -> 192",
        "group 1 (mamba:64): 256 -- state snapshot at 256; snapshots held at <= cap: [64, 128, 192, 256]",
        "reconciliation: candidates 256 -> 192; hit 192",
    ]),
])
def test_each_groups_reason_word_for_word(groups, prompt_len, kw, cold, resend):
    got_cold, got_resend = reasons(groups, prompt_len, **kw)
    if cold is not None:
        assert got_cold == cold
    assert got_resend == resend
