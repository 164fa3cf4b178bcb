"""Pure-PyTorch Mamba2 references over packed variable-length sequences (one call per step for all
prefill chunks of a batch), each sequence continuing from its own initial state.

Shapes as in ssd.py with T = packed tokens of n sequences (`seqs`, see varlen.py). They equal running
ssd.causal_conv1d_ref / ssd.ssd_chunk_scan_ref on every sequence alone (tests/model/test_ssd_varlen.py),
and the CUDA kernels' varlen paths (seq_idx / cu_seqlens) are tested against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.ssd import add_chunk_outputs, bias_activation, chunk_local_terms, head_major_chunks, segsum
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
    N = B.shape[2]
    n, l = seqs.num_seqs, chunk_size
    layout = seqs.chunk_layout(chunk_size)
    x, dt = x.float(), dt.float()
    # head-major chunks; layout row T is the zero row padded chunk positions read
    xdt = head_major_chunks(x * dt[..., None], layout.chunk_rows, l)  # [H, c, l, P]
    Adt = head_major_chunks(A.float()[None, :] * dt, layout.chunk_rows, l)  # [H, c, l]
    B, C = (head_major_chunks(t.float(), layout.chunk_rows, l) for t in (B, C))  # [G, c, l, N]
    nc = xdt.shape[1]
    # 1. intra-chunk (diagonal blocks) and 2. each chunk's contribution to the state at its end
    y, chunk_states, A_cumsum = chunk_local_terms(xdt, Adt, B, C)

    # 3. inter-chunk recurrence per sequence, over its chunks padded to max_chunks (padded chunks have
    #    no decay and no input, so the last state is the state after the sequence's last token)
    m = layout.max_chunks
    padded = chunk_states.new_zeros(H, n * m, P * N).index_copy_(1, layout.chunk_slot, chunk_states.view(H, nc, P * N))
    chunk_decay_end = A_cumsum.new_zeros(H, n * m).index_copy_(1, layout.chunk_slot, A_cumsum[..., -1])
    initial = initial_states.float().view(n, H, P * N).transpose(0, 1)[:, :, None]  # [H, n, 1, P*N]
    states = torch.cat([initial, padded.view(H, n, m, P * N)], dim=2)  # [H, n, m+1, P*N]
    chunk_decay = torch.exp(segsum(F.pad(chunk_decay_end.view(H, n, m), (1, 0))))  # [H, n, m+1, m+1]
    states = torch.matmul(chunk_decay, states)  # [H, n, m+1, P*N]
    final_states = states[:, :, -1].transpose(0, 1).reshape(n, H, P, N)  # [n, H, P, N]
    start_states = states[:, :, :-1].reshape(H, n * m, P * N).index_select(1, layout.chunk_slot)  # [H, c, P*N]

    # 4. state -> output for each chunk's tokens; back to token-major in one gather and the D term
    y = add_chunk_outputs(y, C, start_states.view(H, nc, P, N), A_cumsum)  # [H, c, l, P]
    y = y.view(H, nc * l, P).index_select(1, layout.token_pos).transpose(0, 1)  # [T, H, P] (a view)
    y = y + D.float()[:, None] * x if D is not None else y.contiguous()
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
