"""Torch references: chunked SSD scan == sequential recurrence; conv with state == full conv."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.model.ssd import (
    causal_conv1d_ref,
    causal_conv1d_states_ref,
    chunk_decay,
    conv1d_update_ref,
    segsum,
    selective_state_steps_ref,
    selective_state_update_ref,
    ssd_chunk_scan_ref,
)


def _inputs(L, H=4, P=3, G=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, H, P, generator=g)
    dt = F.softplus(torch.randn(L, H, generator=g) - 1)
    A = -torch.rand(H, generator=g) * 2 - 0.1
    B = torch.randn(L, G, N, generator=g)
    C = torch.randn(L, G, N, generator=g)
    D = torch.randn(H, generator=g)
    h0 = torch.randn(H, P, N, generator=g)
    return x, dt, A, B, C, D, h0


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 40),
    chunk=st.sampled_from([1, 4, 8, 16, 64]),
    seed=st.integers(0, 100),
    with_init=st.booleans(),
)
def test_chunk_scan_equals_recurrence(L, chunk, seed, with_init):
    x, dt, A, B, C, D, h0 = _inputs(L, seed=seed)
    init = h0 if with_init else None
    y, final = ssd_chunk_scan_ref(x, dt, A, B, C, chunk, D, init)
    pool = (h0 if with_init else torch.zeros_like(h0))[None].clone()  # [1, H, P, N]
    slot = torch.tensor([0])
    ys = [
        selective_state_update_ref(pool, slot, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D)
        for t in range(L)
    ]
    torch.testing.assert_close(y, torch.cat(ys), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, pool[0], atol=1e-4, rtol=1e-4)


def test_chunk_scan_split_carries_state():
    x, dt, A, B, C, D, _ = _inputs(50, seed=3)
    y, final = ssd_chunk_scan_ref(x, dt, A, B, C, 16, D)
    y1, s1 = ssd_chunk_scan_ref(x[:21], dt[:21], A, B[:21], C[:21], 16, D)
    y2, s2 = ssd_chunk_scan_ref(x[21:], dt[21:], A, B[21:], C[21:], 16, D, s1)
    torch.testing.assert_close(torch.cat([y1, y2]), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, final, atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(L=st.integers(1, 20), cut=st.integers(0, 20), K=st.sampled_from([2, 4]))
def test_conv_with_state_equals_full_conv(L, cut, K):
    cut = min(cut, L)
    g = torch.Generator().manual_seed(L * 31 + K)
    x, w, b = torch.randn(L, 6, generator=g), torch.randn(6, K, generator=g), torch.randn(6, generator=g)
    full = F.silu(F.conv1d(x.t()[None], w[:, None], b, padding=K - 1, groups=6)[0, :, :L].t())
    y, state = causal_conv1d_ref(x, w, b, None)
    torch.testing.assert_close(y, full)
    y1, s1 = causal_conv1d_ref(x[:cut], w, b, None) if cut else (x[:0], torch.zeros(6, K - 1))
    y2, s2 = causal_conv1d_ref(x[cut:], w, b, s1) if cut < L else (x[:0], s1)
    torch.testing.assert_close(torch.cat([y1, y2]), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s2, state)
    pool = torch.zeros(3, 6, K - 1)
    steps = [conv1d_update_ref(x[t : t + 1], pool, torch.tensor([2]), w, b) for t in range(L)]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool[2], state)
    assert (pool[:2] == 0).all()


def assert_within_ulps(a: torch.Tensor, b: torch.Tensor, max_ulps: int) -> None:
    """|a - b| <= max_ulps units in the last place of the larger magnitude, in a's dtype."""
    assert a.dtype == b.dtype
    a32, b32 = a.float(), b.float()
    big = torch.maximum(a32.abs(), b32.abs()).clamp_min(torch.finfo(a.dtype).tiny)
    ulp = torch.finfo(a.dtype).eps * torch.pow(2.0, torch.floor(torch.log2(big)))
    diff = (a32 - b32).abs()
    assert bool((diff <= max_ulps * ulp).all()), f"max diff {diff.max().item()} > {max_ulps} ulp"


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), L=st.integers(1, 5), seed=st.integers(0, 100),
       state_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_state_steps_equal_token_by_token_updates(b, L, seed, state_dtype):
    """The verify path's one-pass recurrence == L single-step updates on a pool of state_dtype."""
    inputs = [_inputs(L, seed=seed + i) for i in range(b)]
    x, dt, B, C = (torch.stack([inp[k] for inp in inputs]) for k in (0, 1, 3, 4))  # [b, L, ...]
    A, D = inputs[0][2], inputs[0][5]
    h0 = torch.stack([inp[6] for inp in inputs]).to(state_dtype)  # [b, H, P, N]
    y, states = selective_state_steps_ref(h0, x, dt, A, B, C, D, state_dtype)
    pool, slots = h0.clone(), torch.arange(b)
    for j in range(L):
        y_j = selective_state_update_ref(pool, slots, x[:, j], dt[:, j], A, B[:, j], C[:, j], D)
        if state_dtype is torch.float32:
            torch.testing.assert_close(y[:, j], y_j, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(states[:, j], pool, atol=1e-5, rtol=1e-5)
        else:  # bf16: the two paths round the same fp32 values, so they may differ by one ulp
            assert_within_ulps(states[:, j].to(state_dtype), pool, max_ulps=1)
            torch.testing.assert_close(y[:, j], y_j, atol=1e-2, rtol=1e-2)  # y reads the rounded state


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), L=st.integers(1, 5), K=st.sampled_from([2, 4]), seed=st.integers(0, 100))
def test_conv_states_equal_token_by_token_updates(b, L, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, L, 6, generator=g)
    weight, bias = torch.randn(6, K, generator=g), torch.randn(6, generator=g)
    state0 = torch.randn(b, 6, K - 1, generator=g)
    y, states = causal_conv1d_states_ref(x, state0, weight, bias, "silu")
    pool, slots = state0.clone(), torch.arange(b)
    for j in range(L):
        y_j = conv1d_update_ref(x[:, j], pool, slots, weight, bias, "silu")
        torch.testing.assert_close(y[:, j], y_j, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[:, j], pool, atol=0, rtol=0)


def test_chunk_decay_is_exp_of_segment_sums_and_never_overflows():
    """chunk_decay (differences of the running sum as base-2 exponents, clamped at -115: no denormals)
    equals exp(segsum) where the decay is representable, is exactly 0 above the diagonal, and stays
    finite for a chunk whose decay underflows (a segsum-free difference of two sums near -1e4).
    A decay that forgot the causal mask, or clamped the exponent above zero, fails here."""
    g = torch.Generator().manual_seed(7)
    Adt = -torch.rand(3, 2, 16, generator=g)  # [H, c, l]: A dt < 0
    got = chunk_decay(torch.cumsum(Adt, dim=-1))
    torch.testing.assert_close(got, torch.exp(segsum(Adt)), atol=1e-6, rtol=1e-5)
    upper = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)
    assert torch.equal(got[..., upper], torch.zeros_like(got[..., upper]))
    assert torch.equal(torch.diagonal(got, dim1=-2, dim2=-1), torch.ones(3, 2, 16))
    steep = chunk_decay(torch.cumsum(torch.full((1, 1, 64), -150.0), dim=-1))  # runs to -9600
    assert torch.isfinite(steep).all() and steep[0, 0, 1, 0] < 1e-30 and steep[0, 0, 5, 5] == 1
