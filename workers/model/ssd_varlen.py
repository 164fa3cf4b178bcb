"""Pure-PyTorch Mamba2 references over packed variable-length sequences (one call per step for all
prefill chunks of a batch), each sequence continuing from its own initial state.

Shapes as in ssd.py with T = packed tokens of n sequences (`seqs`, see varlen.py). They equal running
ssd.causal_conv1d_ref / ssd.ssd_chunk_scan_ref on every sequence alone (tests/model/test_ssd_varlen.py),
and the CUDA kernels' varlen paths (seq_idx / cu_seqlens) are tested against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.ssd import bias_activation, chunk_local_terms, chunk_outputs, segsum
from workers.model.varlen import VarlenSeqs


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seqs: VarlenSeqs,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over packed sequences, one conv call for all of them.

    x [T, C_], conv_states [n, C_, K-1] (the K-1 inputs before each sequence; zeros for a fresh one),
    weight [C_, K], bias [C_] or None. Returns y [T, C_] (x's dtype) and final states [n, C_, K-1]."""
    channels, K = weight.shape
    layout = seqs.conv_layout(K)
    states = conv_states.to(x.dtype).transpose(1, 2).reshape(-1, channels)  # [n*(K-1), C_]
    ext = torch.cat([states, x]).index_select(0, layout.ext_rows)  # [E = T + n*(K-1), C_]
    # the depthwise conv as K shifted multiply-adds over the token-major buffer: F.conv1d would need the
    # buffer channel-major (a transposed copy) and runs depthwise convs slowly on CPU
    taps = ext.to(weight.dtype)
    width = taps.shape[0] - K + 1  # output positions of a conv without padding
    y = taps[:width] * weight[:, 0]  # [width, C_]
    for k in range(1, K):
        y.addcmul_(taps[k : k + width], weight[:, k])
    y = y.index_select(0, layout.out_cols)  # [T, C_]
    y = bias_activation(y, bias, activation)
    final = ext.index_select(0, layout.final_rows.flatten()).view(-1, K - 1, channels).transpose(1, 2)  # [n, C_, K-1]
    return y.to(x.dtype), final


def ssd_varlen_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None,
    seqs: VarlenSeqs,
    initial_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD over packed sequences in float32: ssd_chunk_scan_ref batched over every chunk of every
    sequence (chunks aligned to sequence starts, see varlen.ChunkLayout).

    x [T, H, P], dt [T, H] (discretised), A [H], B and C [T, G, N], D [H] or None, initial_states
    [n, H, P, N]. Returns y [T, H, P] float32 (includes D * x) and final states [n, H, P, N] float32."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    n, l = seqs.num_seqs, chunk_size
    layout = seqs.chunk_layout(chunk_size)
    x = x.float()
    xdt = x * dt.float()[..., None]  # [T, H, P]
    Adt = A.float()[None, :] * dt.float()  # [T, H]
    B, C = B.float(), C.float()  # [T, G, N]
    # row T of each padded tensor is the zero row padded chunk positions read
    xdt, Adt, B, C = (
        torch.cat([t, t.new_zeros(1, *t.shape[1:])]).index_select(0, layout.chunk_rows) for t in (xdt, Adt, B, C)
    )
    nc = layout.chunk_rows.shape[0] // l
    xdt = xdt.view(nc, l, H, P)  # [c, l, H, P]
    B = B.view(nc, l, G, N)  # [c, l, G, N]
    C = C.view(nc, l, G, N)  # [c, l, G, N]
    Adt = Adt.view(nc, l, H).permute(2, 0, 1)  # [H, c, l]
    # 1. intra-chunk (diagonal blocks) and 2. each chunk's contribution to the state at its end
    y_diag, chunk_states, A_cumsum = chunk_local_terms(xdt, Adt, B, C)

    # 3. inter-chunk recurrence per sequence, over its chunks padded to max_chunks (padded chunks have
    #    no decay and no input, so the last state is the state after the sequence's last token)
    m = layout.max_chunks
    padded = chunk_states.new_zeros(n * m, H, P, N).index_copy_(0, layout.chunk_slot, chunk_states)
    chunk_decay_end = A_cumsum[..., -1].new_zeros(H, n * m).index_copy_(1, layout.chunk_slot, A_cumsum[..., -1])
    chunk_decay_end = chunk_decay_end.view(H, n, m).transpose(0, 1)  # [n, H, m]
    states = torch.cat([initial_states.float()[:, None], padded.view(n, m, H, P, N)], dim=1)  # [n, m+1, H, P, N]
    chunk_decay = torch.exp(segsum(F.pad(chunk_decay_end, (1, 0))))  # [n, H, m+1, m+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)  # [n, m+1, H, P, N]
    final_states = states[:, -1]  # [n, H, P, N]
    start_states = states[:, :-1].reshape(n * m, H, P, N).index_select(0, layout.chunk_slot)  # [c, H, P, N]

    # 4. state -> output for each chunk's tokens
    y = chunk_outputs(y_diag, C, start_states, A_cumsum).reshape(nc * l, H, P).index_select(0, layout.token_pos)
    if D is not None:
        y = y + D.float()[:, None] * x
    return y, final_states


def add_initial_state_contribution(
    y: torch.Tensor,
    final_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    C: torch.Tensor,
    seqs: VarlenSeqs,
    initial_states: torch.Tensor,
    with_state: list[int],
) -> None:
    """The SSM is linear in its state: a scan from h0 equals the scan from zeros plus h0 decayed,
        y_t   += exp(sum_{s<=t} A dt_s) * (C_t . h0)        final += exp(sum_s A dt_s) * h0
    (sums over the sequence). Added in place for the sequences in `with_state`, for kernels that take
    no per-sequence initial state in varlen mode (mamba_ssm's take one per batch row only).
    y [T, H, P] f32, final_states [n, H, P, N] f32, dt [T, H], C [T, G, N], initial_states [n, H, P, N]."""
    H, G = y.shape[1], C.shape[1]
    bounds = seqs.lengths
    start = 0
    starts = []
    for length in bounds:
        starts.append(start)
        start += length
    for i in with_state:
        r = slice(starts[i], starts[i] + bounds[i])
        a_cum = torch.cumsum(A.float()[None] * dt[r].float(), dim=0)  # [L, H]
        h0 = initial_states[i].float()  # [H, P, N]
        Ci = C[r].float().repeat_interleave(H // G, dim=1)  # [L, H, N]
        y[r] += torch.exp(a_cum)[..., None] * torch.einsum("lhn,hpn->lhp", Ci, h0)
        final_states[i] += torch.exp(a_cum[-1])[:, None, None] * h0
