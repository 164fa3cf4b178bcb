"""Varlen torch references: one call over packed sequences == the per-sequence references, each
sequence from its own initial state (zeros for fresh ones)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.model.ssd import causal_conv1d_ref, ssd_chunk_scan_ref
from workers.model.ssd_varlen import add_initial_state_contribution, causal_conv1d_varlen_ref, ssd_varlen_ref
from workers.model.varlen import VarlenSeqs

H, P, G, N = 4, 3, 2, 5


def _packed(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    T, n = sum(lengths), len(lengths)
    x = torch.randn(T, H, P, generator=g)
    dt = F.softplus(torch.randn(T, H, generator=g) - 1)
    A = -torch.rand(H, generator=g) * 2 - 0.1
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    h0 = torch.randn(n, H, P, N, generator=g)
    return x, dt, A, B, C, D, h0


def _rows(lengths):
    out, start = [], 0
    for n in lengths:
        out.append(slice(start, start + n))
        start += n
    return out


lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st, chunk=st.sampled_from([1, 4, 16, 64]), seed=st.integers(0, 100),
       fresh=st.lists(st.booleans(), min_size=5, max_size=5))
def test_ssd_varlen_equals_each_sequence_alone(lengths, chunk, seed, fresh):
    x, dt, A, B, C, D, h0 = _packed(lengths, seed)
    for i, f in enumerate(fresh[: len(lengths)]):
        if f:
            h0[i] = 0
    seqs = VarlenSeqs(tuple(lengths), torch.device("cpu"))
    y, final = ssd_varlen_ref(x, dt, A, B, C, chunk, D, seqs, h0)
    for i, r in enumerate(_rows(lengths)):
        y_i, final_i = ssd_chunk_scan_ref(x[r], dt[r], A, B[r], C[r], chunk, D, h0[i])
        torch.testing.assert_close(y[r], y_i, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[i], final_i, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st, K=st.sampled_from([2, 4]), seed=st.integers(0, 100))
def test_conv_varlen_equals_each_sequence_alone(lengths, K, seed):
    g = torch.Generator().manual_seed(seed)
    T, n, channels = sum(lengths), len(lengths), 6
    x = torch.randn(T, channels, generator=g)
    w, b = torch.randn(channels, K, generator=g), torch.randn(channels, generator=g)
    states = torch.randn(n, channels, K - 1, generator=g)
    states[0] = 0  # a fresh sequence
    y, final = causal_conv1d_varlen_ref(x, states, w, b, VarlenSeqs(tuple(lengths), torch.device("cpu")))
    for i, r in enumerate(_rows(lengths)):
        y_i, final_i = causal_conv1d_ref(x[r], w, b, states[i], "silu")
        torch.testing.assert_close(y[r], y_i, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(final[i], final_i, atol=0, rtol=0)  # a copy of inputs: exact


def test_initial_state_contribution_turns_a_zero_start_scan_into_the_full_one():
    """What the CUDA path does around mamba_ssm's varlen scan (no per-sequence initial states)."""
    lengths = [7, 1, 20, 3]
    x, dt, A, B, C, D, h0 = _packed(lengths, seed=5)
    seqs = VarlenSeqs(tuple(lengths), torch.device("cpu"))
    want_y, want_final = ssd_varlen_ref(x, dt, A, B, C, 4, D, seqs, h0)
    h0[2] = 0  # sequence 2 is fresh: skipped below
    y, final = ssd_varlen_ref(x, dt, A, B, C, 4, D, seqs, torch.zeros_like(h0))
    add_initial_state_contribution(y, final, dt, A, C, seqs, h0, [0, 1, 3])
    want_y2, want_final2 = ssd_varlen_ref(x, dt, A, B, C, 4, D, seqs, h0)
    torch.testing.assert_close(y, want_y2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final2, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(y, want_y)  # sequence 2's real initial state was left out: it matters
