"""Warm output == cold output, token for token; the hit is the hand-derived number; and the warm
request sends exactly (prompt - hit) prompt tokens through the model's forward (the saved work)."""

import pytest

from tests.conftest import make_engine, make_prompt
from workers.engine.sampling_params import SamplingParams

LENGTHS = [1, 17, 63, 64, 65, 130, 257, 400]
# Engine layout: full:16 + mamba:64 (+ draft:16 with MTP), so A = lcm(16, 64) = 64. Identical resend of
# N tokens: the replay boundary R = floor((N - 1) / 64) * 64 is always retained (latest, dense, and the
# 128-token interval alike), and no hit can be larger (L <= N - 1, a multiple of 64), so:
#   no drop (EAGLE off, lossless, or no MTP at all): hit = R
#       N:   1  17  63  64   65  130  257  400
#       R:   0   0   0   0   64  128  256  384
#   drop (MTP, lookahead rule): hit = R when the draft block [R, R + 16) lies inside the prompt
#   (R + 16 <= N: only N = 400, [384, 400)); else R - 64, which drop-mode retention keeps because
#   that lookahead block cannot exist, and whose own lookahead block [R - 64, R - 48) is inside:
#       65 -> 0, 130 -> 64, 257 -> 192, 400 -> 384
HIT_NO_DROP = {1: 0, 17: 0, 63: 0, 64: 0, 65: 64, 130: 128, 257: 256, 400: 384}
HIT_DROP = {1: 0, 17: 0, 63: 0, 64: 0, 65: 0, 130: 64, 257: 192, 400: 384}
MODES = [(0, "lossless"), (3, "drop"), (3, "lossless")]
CASES = [  # (num_spec_tokens, eagle_mode, retention): every EAGLE mode, with and without MTP
    (0, "off", "latest"), (0, "drop", "latest"),
    *[(k, eagle, r) for r in ("latest", "dense", "128") for k, eagle in MODES],
]


@pytest.mark.parametrize("k, eagle, retention", CASES)
def test_warm_equals_cold_hits_by_hand_and_computes_only_the_rest(tiny_model, k, eagle, retention):
    engine = make_engine(tiny_model, num_spec_tokens=k, eagle_mode=eagle, retention=retention)
    expected = HIT_DROP if (k and eagle == "drop") else HIT_NO_DROP
    params = SamplingParams(temperature=0.0, max_tokens=6)
    for n in LENGTHS:
        prompt = make_prompt(n, seed=n)
        (cold,) = engine.generate([prompt], params)
        before, engine_before = tiny_model.forward_counts, engine.num_computed_prompt_tokens
        (warm,) = engine.generate([prompt], params)
        after = tiny_model.forward_counts
        assert cold.num_cached_tokens == 0 and cold.num_computed_prompt_tokens == n
        assert warm.token_ids == cold.token_ids, f"n={n}"
        hit = expected[n]
        assert warm.num_cached_tokens == hit, f"n={n}"
        # the work: a hit that recomputed the prompt from zero state would still give equal outputs
        assert warm.num_computed_prompt_tokens == n - hit, f"n={n}"
        assert engine.num_computed_prompt_tokens - engine_before == n - hit
        assert after.num_prompt_tokens - before.num_prompt_tokens == n - hit  # as the model counted it
        if not k:  # every row the model ran: the prompt's rest, then one row per later output token
            assert after.num_tokens - before.num_tokens == n - hit + len(warm.token_ids) - 1, f"n={n}"
        engine.cache.check_integrity()
    assert not engine.has_unfinished()


def test_prefix_cache_off_never_hits(tiny_model):
    engine = make_engine(tiny_model, num_spec_tokens=0, enable_prefix_caching=False)
    prompt = make_prompt(300, 3)
    a, b = engine.generate([prompt, prompt], SamplingParams(temperature=0.0, max_tokens=4))
    (c,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    assert a.num_cached_tokens == b.num_cached_tokens == c.num_cached_tokens == 0
    assert a.token_ids == b.token_ids == c.token_ids


@pytest.mark.parametrize("k, eagle", MODES)
def test_second_chat_turn_hits_at_the_first_turns_final_boundary(tiny_model, k, eagle):
    engine = make_engine(tiny_model, num_spec_tokens=k, eagle_mode=eagle)
    first = make_prompt(170, 11)
    (turn1,) = engine.generate([first], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    computed = len(first) + len(turn1.token_ids) - 1
    final = computed // 64 * 64
    second = first + list(turn1.token_ids) + make_prompt(30, 12)
    (turn2,) = engine.generate([second], SamplingParams(temperature=0.0, max_tokens=8))
    # drop (lookahead): the draft block [final, final + 16) proves the successor token when turn 1
    # computed past it; otherwise the hit lands one alignment unit (64) below
    expected = final - 64 if (k and eagle == "drop" and final + 16 > computed) else final
    assert final > 170 and turn2.num_cached_tokens == expected
    fresh = make_engine(tiny_model, num_spec_tokens=k, eagle_mode=eagle)
    (cold,) = fresh.generate([second], SamplingParams(temperature=0.0, max_tokens=8))
    assert turn2.token_ids == cold.token_ids


def test_shared_system_prompt_junction(tiny_model):
    engine = make_engine(tiny_model, num_spec_tokens=3, eagle_mode="lossless")
    system = make_prompt(300, 21)
    outs = [engine.generate([system + make_prompt(40, 30 + i)], SamplingParams(temperature=0.0,
                                                                               max_tokens=4))[0] for i in range(3)]
    assert outs[0].num_cached_tokens == 0
    assert outs[2].num_cached_tokens == 256  # the junction snapshot taken by the second request
    fresh = make_engine(tiny_model, num_spec_tokens=3, eagle_mode="lossless")
    (cold,) = fresh.generate([system + make_prompt(40, 32)], SamplingParams(temperature=0.0, max_tokens=4))
    assert cold.token_ids == outs[2].token_ids


def test_tenants_do_not_share_prefixes(tiny_model):
    engine = make_engine(tiny_model, num_spec_tokens=0)
    prompt = make_prompt(300, 5)
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), cache_salt="a")
    (other,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), cache_salt="b")
    (same,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), cache_salt="a")
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 256


@pytest.mark.parametrize("eagle", ["drop", "lossless"])
def test_admission_never_evicts_the_pages_it_restores_from(tiny_model, eagle):
    """Regression: admission allocated the request's state slots (evicting LRU free pages) before
    fetching the hit's Mamba page, so a hit page first in the LRU queue was recycled mid-admission."""
    engine = make_engine(tiny_model, num_spec_tokens=3, eagle_mode=eagle)
    prompt = make_prompt(500, 31)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (cold,) = engine.generate([prompt], params)
    for group in (1, 2):  # the hit's Mamba page and (lossless) draft block: next in line for eviction
        pool = engine.cache.pools[group]
        # the kept queue's blocks (every block the hit uses; spare ones lie above every state)
        for block in [b for b in pool.cached.values() if b.block_id in pool._free]:
            pool._free.move_to_end(block.block_id, last=False)
    (warm,) = engine.generate([prompt], params)
    # R = floor(499 / 64) * 64 = 448; drop: its lookahead block [448, 464) lies inside the 500 tokens
    assert warm.num_cached_tokens == 448 and warm.token_ids == cold.token_ids
    assert warm.num_computed_prompt_tokens == 500 - 448
    engine.cache.check_integrity()


# Engine layout with MTP: full:16 + mamba:64 + draft:16, so A = 64 and the draft group drops.
# Identical resend of N tokens, latest retention: R = floor((N - 1) / 64) * 64.
#   lookahead: hit R when the draft block [R, R + 16) lies inside the prompt (R + 16 <= N), else
#              R - 64 (retention kept it because that block cannot exist)
#   alignment: always R - 64
DROP_HITS = [
    # N,   lookahead, alignment
    (100, 64, 0),  # R = 64, [64, 80) inside 100
    (80, 64, 0),  # R = 64, [64, 80) ends exactly at the prompt's last token
    (70, 0, 0),  # R = 64, [64, 80) runs past 70
    (200, 128, 128),  # R = 192, [192, 208) runs past 200
    (300, 256, 192),  # R = 256, [256, 272) inside 300
]


@pytest.mark.parametrize("rule", ["lookahead", "alignment"])
def test_drop_hits_by_hand_and_warm_equals_cold(tiny_model, rule):
    engine = make_engine(tiny_model, num_spec_tokens=3, eagle_mode="drop", drop_rule=rule)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for n, lookahead, alignment in DROP_HITS:
        prompt = make_prompt(n, seed=1000 + n)
        (cold,) = engine.generate([prompt], params)
        (warm,) = engine.generate([prompt], params)
        assert warm.num_cached_tokens == (lookahead if rule == "lookahead" else alignment), f"n={n}"
        assert warm.token_ids == cold.token_ids, f"n={n}"
        engine.cache.check_integrity()
