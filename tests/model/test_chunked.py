"""Chunked prefill == one-chunk prefill: Mamba state carried through state_slot, KV through block tables."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.model.helpers import make_table, make_tokens, run_chunks

ATOL = 1e-4
N = 150


@pytest.fixture(scope="module")
def full_logits(model):
    ids = make_tokens(N, seed=11)
    caches = model.allocate_caches(16, 16, 2)
    return ids, run_chunks(model, caches, ids, [N], make_table(10, 0, 16), slot=0)


@pytest.mark.parametrize(
    "splits",
    [
        [1, N - 1],
        [63, 1, 86],
        [64, 64, 22],
        [16, 16, 100, 18],
        [5, 60, 3, 1, 1, 80],
        [149, 1],
    ],
)
def test_split_prefill_matches_single_chunk(model, full_logits, splits):
    ids, ref = full_logits
    caches = model.allocate_caches(12, 16, 4)
    got = run_chunks(model, caches, ids, splits, make_table(10, 1, 12), slot=3)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cuts=st.lists(st.integers(1, N - 1), min_size=1, max_size=4, unique=True),
    block_size=st.sampled_from([4, 16]),
)
def test_random_splits_and_block_sizes(model, full_logits, cuts, block_size):
    ids, ref = full_logits
    bounds = [0, *sorted(cuts), N]
    splits = [b - a for a, b in zip(bounds, bounds[1:])]
    pool = -(-N // block_size) + 5
    caches = model.allocate_caches(pool, block_size, 2)
    got = run_chunks(model, caches, ids, splits, make_table(pool - 5, 9, pool), slot=1)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_restored_snapshot_and_kv_blocks_continue_exactly(model, full_logits):
    """The engine's prefix-cache hit: copy a Mamba snapshot taken at 64 into a fresh slot, reuse the KV
    blocks of [0, 64), and continue; also a second sequence branching from the same snapshot."""
    ids, ref = full_logits
    caches = model.allocate_caches(24, 16, 4)
    perm = make_table(24, 2, 24)
    table = perm[:10]
    run_chunks(model, caches, ids[:64], [64], table, slot=0)
    caches.copy_state(0, 2)  # snapshot at position 64
    caches.zero_state(0)
    run_chunks(model, caches, make_tokens(30, seed=99), [30], perm[10:12], slot=1)  # unrelated traffic
    new_table = torch.cat([table[:4], perm[12:18]])  # cached blocks [0, 64) + fresh ones
    got = run_chunks(model, caches, ids[64:], [40, 46], new_table, slot=2, start=64)
    torch.testing.assert_close(got, ref[64:], atol=ATOL, rtol=0)


def test_context_zero_ignores_stale_slot_contents(model, full_logits):
    ids, ref = full_logits
    caches = model.allocate_caches(12, 16, 1)
    for conv in caches.conv.values():
        conv.normal_()
    for ssm in caches.ssm.values():
        ssm.normal_()
    got = run_chunks(model, caches, ids[:20], [20], make_table(2, 4, 12), slot=0)
    torch.testing.assert_close(got, ref[:20], atol=ATOL, rtol=0)
    caches.ssm[0].normal_()
    caches.conv[0].normal_()
    got1 = run_chunks(model, caches, ids[:1], [1], make_table(1, 4, 12), slot=0)  # 1-token, context 0
    torch.testing.assert_close(got1, ref[:1], atol=ATOL, rtol=0)
