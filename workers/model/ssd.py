"""Pure-PyTorch Mamba2 references: chunked SSD scan, causal depthwise conv, single-step state update.

Shapes per sequence (no batch dim; sequences of a batch have different lengths): L tokens, H = nheads,
P = head_dim, G = ngroups, N = d_state, C_ = conv channels, K = d_conv. `dt` is already discretised
(softplus(dt + dt_bias), clamped): the caller owns that, so prefill and decode clamp identically.
The CUDA kernels in kernels.py are tested against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bias_activation(y: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """The conv's bias and activation (silu or none), shared by every conv reference and kernel."""
    if bias is not None:
        y = y + bias
    if activation == "silu":
        return F.silu(y)
    if activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return y


def segsum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, -inf above the diagonal. x: [..., T]."""
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)  # [..., T, T]; x[..., i, j] = x_i
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~below, 0)
    out = torch.cumsum(x, dim=-2)  # [..., T, T]
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~keep, -torch.inf)


# The decay is exp2 of base-2 exponents: on CPU torch.exp runs ~4.5x slower than torch.exp2 over the
# [H, c, l, l] tensor (AVX512: 330 vs 72 us for 0.5M floats); the rescaled exponent moves the result by
# ~|x| * 2^-24 relatively, far inside float32 noise of the sums it feeds. 2^-115 ~ 2e-35 is nothing
# next to float32 sums of O(1) terms and keeps exp2 out of denormal results (a slow path)
_LOG2E = 1.4426950408889634
_EXP2_FLOOR = -115.0


def chunk_decay(A_cumsum: torch.Tensor) -> torch.Tensor:
    """decay[..., i, j] = exp(A_cumsum[i] - A_cumsum[j]) = exp(sum(A dt over (j, i])) for j <= i, 0 above
    the diagonal. A_cumsum [..., l] (non-increasing: A < 0, dt > 0) -> [..., l, l]. Differences of the
    running sum, as mamba_ssm's kernels take them (segsum's exact segment sums cost a strided cumsum
    over the [l, l] tensor)."""
    l = A_cumsum.shape[-1]
    a2 = A_cumsum * _LOG2E  # [..., l]: base-2 exponents
    diff = a2[..., :, None] - a2[..., None, :]  # [..., l, l]; <= 0 on and below the diagonal
    causal = torch.ones(l, l, dtype=diff.dtype, device=diff.device).tril_()  # 1 on and below the diagonal
    return diff.clamp_(min=_EXP2_FLOOR, max=0.0).exp2_().mul_(causal)


def chunk_local_terms(
    xdt: torch.Tensor, Adt: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1 and 2 of the chunked scan, head-major (float32): xdt [H, c, l, P], Adt [H, c, l], B and C
    [G, c, l, N] (the H/G heads of a group share them). Head-major keeps every product a plain batched
    matmul over (head, chunk): no operand is permuted into a copy. Returns y_diag [H, c, l, P] (each
    chunk's output from its own tokens: attention-like with a decay mask), chunk_states [H, c, P, N]
    (each chunk's own contribution to the state at its end) and A_cumsum [H, c, l]."""
    H, c, l, P = xdt.shape
    G, N = B.shape[0], B.shape[3]
    A_cumsum = torch.cumsum(Adt, dim=-1)  # [H, c, l]
    scores = chunk_decay(A_cumsum)  # [H, c, l, s]
    CB = torch.matmul(C, B.transpose(-1, -2))  # [G, c, l, s]: once per group, not per head
    scores.view(G, H // G, c, l, l).mul_(CB[:, None])  # [H, c, l, s]
    y_diag = torch.matmul(scores, xdt)  # [H, c, l, P]
    decay_to_end = torch.exp(A_cumsum[..., -1:] - A_cumsum)  # [H, c, l]
    xw = (xdt * decay_to_end[..., None]).view(G, H // G, c, l, P)  # [G, H/G, c, l, P]
    chunk_states = torch.matmul(xw.transpose(-1, -2), B[:, None])  # [G, H/G, c, P, N]
    return y_diag, chunk_states.view(H, c, P, N), A_cumsum


def add_chunk_outputs(
    y_diag: torch.Tensor, C: torch.Tensor, start_states: torch.Tensor, A_cumsum: torch.Tensor
) -> torch.Tensor:
    """Step 4, in place on y_diag: each chunk's tokens read the state at the chunk's start, decayed to
    them. y_diag [H, c, l, P], C [G, c, l, N], start_states [H, c, P, N], A_cumsum [H, c, l] ->
    y_diag (= the chunks' outputs)."""
    H, c, l, P = y_diag.shape
    G, N = C.shape[0], C.shape[3]
    from_start = torch.matmul(C[:, None], start_states.view(G, H // G, c, P, N).transpose(-1, -2))  # [G, H/G, c, l, P]
    return y_diag.addcmul_(from_start.view(H, c, l, P), torch.exp(A_cumsum)[..., None])


def head_major_chunks(t: torch.Tensor, rows: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Token-major t [T, K, ...] -> head-major chunks [K, c, chunk_size, ...] in one gather: position j
    of the layout reads token rows[j], and rows[j] == T reads a zero row (padding)."""
    padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])  # [T + 1, K, ...]
    return padded.transpose(0, 1).index_select(1, rows).view(t.shape[1], -1, chunk_size, *t.shape[2:])


def ssd_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD (Mamba2 paper, "minimal" form) over one sequence, in float32.

    x [L, H, P], dt [L, H] (discretised), A [H] (= -exp(A_log)), B and C [L, G, N], D [H] or None,
    initial_state [H, P, N] or None (zeros). Returns y [L, H, P] (float32, includes D * x) and the
    final state [H, P, N] (float32) after the last token.
    """
    L, H, P = x.shape
    N = B.shape[2]
    x = x.float()
    dt = dt.float()
    nc = -(-L // chunk_size)
    # padded tokens read the zero row: dt = 0, no decay and no input, so they leave the final state alone
    rows = torch.arange(nc * chunk_size, device=x.device).clamp_(max=L)
    xdt = head_major_chunks(x * dt[..., None], rows, chunk_size)  # [H, c, l, P]
    Adt = head_major_chunks(A.float()[None, :] * dt, rows, chunk_size)  # [H, c, l]
    B, C = (head_major_chunks(t.float(), rows, chunk_size) for t in (B, C))  # [G, c, l, N]
    y, chunk_states, A_cumsum = chunk_local_terms(xdt, Adt, B, C)  # 1. and 2.

    # 3. inter-chunk recurrence: state at the start of every chunk, and the final one
    if initial_state is None:
        initial_state = torch.zeros(H, P, N, dtype=torch.float32, device=x.device)
    states = torch.cat([initial_state.float()[:, None], chunk_states], dim=1)  # [H, c+1, P, N]
    chunk_decay = torch.exp(segsum(F.pad(A_cumsum[..., -1], (1, 0))))  # [H, c+1, c+1]
    states = torch.matmul(chunk_decay, states.view(H, nc + 1, P * N)).view(H, nc + 1, P, N)  # [H, c+1, P, N]
    start_states, final_state = states[:, :-1], states[:, -1]  # [H, c, P, N], [H, P, N]

    y = add_chunk_outputs(y, C, start_states, A_cumsum)  # 4. [H, c, l, P]
    y = y.view(H, nc * chunk_size, P)[:, :L].transpose(0, 1)  # [L, H, P] (a view)
    y = y + D.float()[:, None] * x if D is not None else y.contiguous()
    return y, final_state


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over one sequence, continuing from `conv_state`.

    x [L, C_], weight [C_, K], bias [C_] or None, conv_state [C_, K-1] (the K-1 inputs before x; zeros
    if None). Returns y [L, C_] (in x's dtype) and the new conv state [C_, K-1] (last K-1 inputs).
    """
    L, channels = x.shape
    K = weight.shape[1]
    if conv_state is None:
        conv_state = torch.zeros(channels, K - 1, dtype=x.dtype, device=x.device)
    xs = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C_, K-1+L]
    y = F.conv1d(xs[None].to(weight.dtype), weight[:, None, :], bias, groups=channels)[0]  # [C_, L]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return y.t().to(x.dtype), xs[:, -(K - 1) :].clone()


def conv1d_update_ref(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per sequence. x [B, C_], conv_pool [S, C_, K-1] (updated in place at `slots`),
    slots int64 [B] (distinct). Returns y [B, C_]."""
    state = conv_pool.index_select(0, slots)  # [B, C_, K-1]; index_select: a fast gather on CPU
    xs = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C_, K]
    y = (xs.to(weight.dtype) * weight[None]).sum(-1)  # [B, C_]
    y = bias_activation(y, bias, activation)
    conv_pool.index_copy_(0, slots, xs[:, :, 1:].to(conv_pool.dtype).contiguous())  # contiguous: faster scatter
    return y.to(x.dtype)


def selective_state_update_ref(
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """One recurrence step per sequence: h = exp(dt*A) h + dt * B x;  y = C h + D x.

    ssm_pool [S, H, P, N] (updated in place at `slots`), slots int64 [B] (distinct), x [B, H, P],
    dt [B, H] (discretised), A [H], B and C [B, G, N], D [H] or None. Returns y [B, H, P] float32.
    """
    H, G = x.shape[1], B.shape[1]
    state = ssm_pool.index_select(0, slots).float()  # [B, H, P, N]: a copy, updated in place below
    dt = dt.float()
    B = B.float().repeat_interleave(H // G, dim=1)  # [B, H, N]
    C = C.float().repeat_interleave(H // G, dim=1)  # [B, H, N]
    x = x.float()
    dA = torch.exp(dt * A.float()[None])  # [B, H]
    dBx = (dt[..., None] * x)[..., None] * B[:, :, None, :]  # [B, H, P, N]
    state.mul_(dA[..., None, None]).add_(dBx)  # [B, H, P, N]
    ssm_pool.index_copy_(0, slots, state.to(ssm_pool.dtype))
    y = torch.einsum("bhpn,bhn->bhp", state, C)  # [B, H, P]
    if D is not None:
        y = y + D.float()[:, None] * x
    return y


def causal_conv1d_states_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens for each of B sequences, keeping the conv state after every token (verify chunks).

    x [B, L, C_], conv_state [B, C_, K-1]. Returns y [B, L, C_] (in x's dtype) and states
    [B, L, C_, K-1] (a strided view): states[:, j] = the last K-1 inputs after token j.
    """
    K = weight.shape[1]
    xs = torch.cat([conv_state.to(x.dtype).transpose(1, 2), x], dim=1)  # [B, K-1+L, C_]
    windows = xs.unfold(1, K, 1)  # [B, L, C_, K]: token j's window, as conv1d_update_ref sees it
    y = (windows.to(weight.dtype) * weight).sum(-1)  # [B, L, C_]
    y = bias_activation(y, bias, activation)
    return y.to(x.dtype), windows[..., 1:]


def selective_state_steps_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    state_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L recurrence steps for each of B sequences, keeping the state after every token (verify chunks).

    state [B, H, P, N] (the state before the first token), x [B, L, H, P], dt [B, L, H] (discretised),
    A [H], B and C [B, L, G, N], D [H] or None. Returns y [B, L, H, P] float32 and states
    [B, L, H, P, N] float32. Step by step as selective_state_update_ref with a pool of `state_dtype`:
    each step's output uses the unrounded state, the next step starts from it rounded.
    """
    Bsz, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    x, dt = x.float(), dt.float()
    dA = torch.exp(dt * A.float()).view(Bsz, L, H, 1, 1)  # [B, L, H, 1, 1]
    xdt = (dt[..., None] * x).view(Bsz, L, G, H // G * P, 1)  # [B, L, G, H/G*P, 1]: heads of a group
    dBx = (xdt * B.float()[:, :, :, None, :]).view(Bsz, L, H, P, N)  # [B, L, H, P, N]
    states = torch.empty_like(dBx)  # [B, L, H, P, N]
    h = state.float()  # [B, H, P, N]
    for j in range(L):
        torch.addcmul(dBx[:, j], h, dA[:, j], out=states[:, j])
        h = states[:, j] if state_dtype == torch.float32 else states[:, j].to(state_dtype).float()
    y = torch.einsum("blgqn,blgn->blgq", states.view(Bsz, L, G, H // G * P, N), C.float())  # [B, L, G, H/G*P]
    y = y.reshape(Bsz, L, H, P)
    if D is not None:
        y = y + D.float()[:, None] * x
    return y, states
