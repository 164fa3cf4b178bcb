"""Mamba2 mixer over state slots: prefill chunks (chunked SSD scan) and decode steps (recurrence).

    in_proj(x) -> z [d_inner] | xBC [conv_dim] | dt [nheads]
    xBC -> causal depthwise conv (state: last d_conv-1 inputs) -> silu -> x [nheads, head_dim] | B | C
    dt  -> softplus(dt + dt_bias), clamped below at time_step_min;  A = -exp(A_log)
    y   = SSD(x, dt, A, B, C) + D * x        (state h [nheads, head_dim, d_state] per slot)
    out = out_proj(GatedRMSNorm(y, z))       (norm over ngroups groups, gate silu(z) applied first)

Every chunk starts from its state slot (zeros when num_context_tokens == 0) and leaves its final state
there. Per step (mamba_plan.MambaPlan): one-token chunks go through a single batched recurrence step
(kernels.conv1d_update / state_update); all prefill chunks through one varlen conv and one varlen SSD scan
(kernels.conv1d / ssd_scan with cu_seqlens / seq_idx, an initial state per sequence). Verify chunks
(per_token_state_slots) of equal length go through one pass of the torch references
causal_conv1d_states_ref / selective_state_steps_ref, whatever the kernel set: they return the state after
every token, written straight into its per-token slot (one copy per pool and layer).

Note: transformers clamps dt only in its chunked path, not in its cached one-token step; we clamp in
both, so decode here equals a full no-cache forward of the same prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.config import HybridModelConfig
from workers.model.forward_batch import VerifyGroup
from workers.model.kernels import KernelSet
from workers.model.linear import Linear
from workers.model.mamba_plan import MambaPlan, PrefillPlan
from workers.model.norms import GatedRMSNorm
from workers.model.rows import Index, copy_rows_, put, take
from workers.model.ssd import causal_conv1d_states_ref, selective_state_steps_ref


def _write(pool: torch.Tensor, index: Index, src: torch.Tensor) -> None:
    """pool[index] = src.flatten(0, 1) as one copy; src [b, L, ...] (any strides)."""
    if isinstance(index, slice):
        pool[index].view(src.shape).copy_(src)
    else:
        copy_rows_(pool, index, src.reshape(-1, *pool.shape[1:]))


class Mamba2Mixer(nn.Module):
    """Parameter names match transformers' NemotronHMamba2Mixer (Granite's / Bamba's `mamba` too).
    Shard-friendly: a TP rank holds nheads/tp heads, ngroups/tp groups, and the matching rows of in_proj /
    columns of out_proj."""

    def __init__(self, config: HybridModelConfig, kernels: KernelSet) -> None:
        super().__init__()
        self.nheads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.d_state = config.ssm_state_size
        self.ngroups = config.n_groups
        self.d_inner = config.d_inner
        self.conv_dim = config.conv_dim
        self.chunk_size = config.chunk_size
        self.dt_min, self.dt_max = config.dt_limit
        self.kernels = kernels
        self.in_proj = Linear(config.hidden_size, config.in_proj_dim, bias=config.use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            config.conv_kernel,
            groups=self.conv_dim,
            bias=config.use_conv_bias,
            padding=config.conv_kernel - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.nheads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.nheads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.nheads))
        self.norm = GatedRMSNorm(self.d_inner, self.ngroups, config.layer_norm_epsilon)
        self.out_proj = Linear(self.d_inner, config.hidden_size, bias=config.use_bias)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xbc [n, conv_dim] -> x [n, H, P], B [n, G, N], C [n, G, N]."""
        n = xbc.shape[0]
        gn = self.ngroups * self.d_state
        x, B, C = torch.split(xbc, [self.d_inner, gn, gn], dim=-1)
        return (
            x.reshape(n, self.nheads, self.head_dim),
            B.reshape(n, self.ngroups, self.d_state),
            C.reshape(n, self.ngroups, self.d_state),
        )

    def _step(
        self,
        xbc_raw: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        slots: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        """One token for each of len(slots) sequences: xbc_raw [B, conv_dim], dt [B, H] -> y [B, H, P]."""
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, d_conv]
        xbc = self.kernels.conv1d_update(xbc_raw, conv_pool, slots, weight, self.conv1d.bias, "silu")
        x, B, C = self._split_xbc(xbc)
        return self.kernels.state_update(ssm_pool, slots, x, dt, A, B, C, self.D)  # [B, H, P]

    def _verify(
        self,
        group: VerifyGroup,
        xbc_raw: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        y: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> None:
        """All tokens of a group's verify chunks at once: y rows filled, the state after every token
        written straight into its per-token slot (one copy per pool), the last one into state_slot."""
        nb, L = group.num_chunks, group.num_new_tokens
        rows, slots, dst = group.rows, group.state_slots, group.token_slots
        if group.fresh_slots:
            conv_pool[list(group.fresh_slots)] = 0
            ssm_pool[list(group.fresh_slots)] = 0
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, d_conv]
        xbc, conv_states = causal_conv1d_states_ref(
            take(xbc_raw, rows).view(nb, L, self.conv_dim), take(conv_pool, slots), weight, self.conv1d.bias, "silu"
        )  # [b, L, conv_dim], [b, L, conv_dim, d_conv-1]
        x, B, C = self._split_xbc(xbc.reshape(nb * L, self.conv_dim))
        y_group, ssm_states = selective_state_steps_ref(
            take(ssm_pool, slots),
            x.view(nb, L, self.nheads, self.head_dim),
            take(dt, rows).view(nb, L, self.nheads),
            A,
            B.view(nb, L, self.ngroups, self.d_state),
            C.view(nb, L, self.ngroups, self.d_state),
            self.D,
            ssm_pool.dtype,
        )  # [b, L, H, P], [b, L, H, P, N]
        put(y, rows, y_group.view(nb * L, self.nheads, self.head_dim))
        _write(conv_pool, dst, conv_states)
        _write(ssm_pool, dst, ssm_states)
        _write(conv_pool, slots, conv_states[:, -1:])  # last: a per-token slot may be the state slot
        _write(ssm_pool, slots, ssm_states[:, -1:])

    def _prefill(
        self,
        p: PrefillPlan,
        xbc_raw: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        y: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> None:
        """All prefill chunks at once (varlen): y rows filled, each chunk's final state in its slot."""
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, d_conv]
        keep = p.has_state[:, None, None]  # [n, 1, 1]; where(), not a product: a fresh slot may hold NaN
        conv0 = torch.where(keep, conv_pool.index_select(0, p.slots), 0)  # [n, conv_dim, d_conv-1]
        xbc, conv_final = self.kernels.conv1d(take(xbc_raw, p.rows), conv0, weight, self.conv1d.bias, p.seqs, "silu")
        copy_rows_(conv_pool, p.slots, conv_final)  # [n, conv_dim, d_conv-1]
        x, B, C = self._split_xbc(xbc)  # [T_p, H, P], [T_p, G, N], [T_p, G, N]
        h0 = torch.where(keep[..., None], ssm_pool.index_select(0, p.slots).float(), 0)  # [n, H, P, N]
        y_p, final = self.kernels.ssd_scan(
            x, take(dt, p.rows), A, B, C, self.chunk_size, self.D, p.seqs, h0, p.with_state
        )  # [T_p, H, P], [n, H, P, N]
        put(y, p.rows, y_p)
        copy_rows_(ssm_pool, p.slots, final)

    def forward(
        self, hidden: torch.Tensor, plan: MambaPlan, conv_pool: torch.Tensor, ssm_pool: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, hidden_size] (normed) -> [T, hidden_size]; updates the chunks' state slots in place."""
        T = hidden.shape[0]
        proj = self.in_proj(hidden)  # [T, in_proj_dim]
        z, xbc_raw, dt_raw = torch.split(proj, [self.d_inner, self.conv_dim, self.nheads], dim=-1)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float()).clamp(min=self.dt_min, max=self.dt_max)  # [T, H]
        A = -torch.exp(self.A_log.float())  # [H]
        y = torch.empty(T, self.nheads, self.head_dim, dtype=torch.float32, device=hidden.device)  # [T, H, P]
        if plan.decode is not None:
            d = plan.decode
            if d.fresh_slots is not None:
                conv_pool.index_fill_(0, d.fresh_slots, 0)
                ssm_pool.index_fill_(0, d.fresh_slots, 0)
            put(y, d.rows, self._step(take(xbc_raw, d.rows), take(dt, d.rows), A, d.slots, conv_pool, ssm_pool))
        for group in plan.verify:
            self._verify(group, xbc_raw, dt, A, y, conv_pool, ssm_pool)
        if plan.prefill is not None:
            self._prefill(plan.prefill, xbc_raw, dt, A, y, conv_pool, ssm_pool)
        out = self.norm(y.view(T, self.d_inner), z)  # [T, d_inner]
        return self.out_proj(out.to(hidden.dtype))  # [T, hidden_size]
