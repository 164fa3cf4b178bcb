"""Kernel choice: `auto | torch | cuda` -> a `KernelSet` of five functions the layers call, each over the
whole batch of one step (varlen: packed sequences with per-sequence metadata, see varlen.py / paged_plan.py).

- `torch`: the references in ssd.py / ssd_varlen.py (the two decode updates in fewer passes, below) plus
           torch SDPA (grouped, padded) restricted to an explicit backend list per device
           (sdpa_backends.py: never cuDNN, which re-plans per sequence length). Runs anywhere.
- `cuda`:  mamba_ssm (SSD scan with seq_idx / cu_seqlens, selective state update), causal_conv1d
           (varlen conv with seq_idx, conv update), flash_attn (flash_attn_varlen_func with cu_seqlens).
           A missing package or no CUDA device raises KernelUnavailableError; never a silent fallback.
- `auto`:  `cuda` if every package is installed AND the model lives on a CUDA device, else `torch`.

The choice, with the attention backend, is logged once per (choice, device). The CUDA wrappers are kept
thin and only run on GPU tests (tests/model/test_kernels.py, marked gpu).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.model.errors import KernelUnavailableError
from workers.model.paged_plan import PagedPlan
from workers.model.rows import copy_rows_
from workers.model.sdpa_backends import describe, sdpa_backends_for, sdpa_context
from workers.model.ssd import bias_activation
from workers.model.ssd_varlen import add_initial_state_contribution, causal_conv1d_varlen_ref, ssd_varlen_ref
from workers.model.varlen import VarlenSeqs

log = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "torch", "cuda")
CUDA_PACKAGES = ("mamba_ssm", "causal_conv1d", "flash_attn")
_logged: set[tuple[str, str, str]] = set()


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of the last n positions over all S positions (bottom-right aligned).

    q [n, H, hd] (positions S-n .. S-1), k and v [S, Hkv, hd]. Returns [n, H, hd].
    """
    n, S = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)  # [S, H, hd]
    v = v.repeat_interleave(rep, dim=1)  # [S, H, hd]
    q_pos = torch.arange(S - n, S, device=q.device)  # [n]
    mask = torch.arange(S, device=q.device)[None, :] <= q_pos[:, None]  # [n, S]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )  # [H, n, hd]
    return out.transpose(0, 1)


def paged_attention_ref(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, plan: PagedPlan, scale: float
) -> torch.Tensor:
    """Every chunk's queries over its own positions [0, S_i) of the paged pool, one SDPA per group of
    chunks (plan.sdpa_groups); each chunk equals attention_ref on its gathered keys. SDPA picks its
    backend by PyTorch's default order here: the kernel sets wrap it (`_with_sdpa_backends`).

    q [T, H, hd], k_slots and v_slots [num_slots, Hkv, hd] (the pool, flat). Returns [T, H, hd]."""
    out = torch.empty_like(q)  # [T, H, hd]
    for g in plan.sdpa_groups:
        b, n_max, s_max = g.mask.shape[0], g.mask.shape[2], g.mask.shape[3]
        qg = q.index_select(0, g.q_rows.flatten()).view(b, n_max, *q.shape[1:])  # [b, n_max, H, hd]
        k = k_slots.index_select(0, g.key_slots.flatten()).view(b, s_max, *k_slots.shape[1:])  # [b, s_max, Hkv, hd]
        v = v_slots.index_select(0, g.key_slots.flatten()).view(b, s_max, *v_slots.shape[1:])  # [b, s_max, Hkv, hd]
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2), k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2),
            attn_mask=g.mask, scale=scale, enable_gqa=True,
        ).transpose(1, 2)  # [b, n_max, H, hd]
        o = o.reshape(b * n_max, *q.shape[1:])  # [b * n_max, H, hd]
        if g.valid_pos is not None:  # padded query rows: drop them
            o = o.index_select(0, g.valid_pos)
        copy_rows_(out, g.out_rows, o)
    return out


def conv1d_update_torch(x, conv_pool, slots, weight, bias, activation="silu"):
    """conv1d_update_ref without materialising the [B, C_, K] window: one multiply-add per tap over
    [B, C_] (a product-sum over the size K-1 last dim is a slow strided reduction on CPU), and the shifted
    state written back as one scatter. Equal to the reference up to float reassociation."""
    K = weight.shape[1]
    state = conv_pool.index_select(0, slots)  # [B, C_, K-1]: a copy
    y = x.to(weight.dtype) * weight[:, K - 1]  # [B, C_]
    for k in range(K - 1):
        y.addcmul_(state[:, :, k], weight[:, k])
    y = bias_activation(y, bias, activation)
    shifted = torch.empty_like(state)  # [B, C_, K-1]: the state after x
    shifted[:, :, : K - 2] = state[:, :, 1:]
    shifted[:, :, K - 2] = x
    copy_rows_(conv_pool, slots, shifted)
    return y.to(x.dtype)


def state_update_torch(ssm_pool, slots, x, dt, A, B, C, D=None):
    """selective_state_update_ref in fewer passes over the [B, H, P, N] states (the decode hot spot on CPU):
    in-place decay, the input outer product per group with addcmul_, y as a product-sum per group.
    Equal to the reference up to float reassociation (tests/model/test_kernels.py)."""
    Bsz, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    state = ssm_pool.index_select(0, slots).float()  # [B, H, P, N]: a copy
    dt = dt.float()
    state.mul_(torch.exp(dt * A.float())[..., None, None])
    grouped = state.view(Bsz, G, H // G * P, N)  # heads of a group share B and C
    grouped.addcmul_((x.float() * dt[..., None]).view(Bsz, G, H // G * P, 1), B.float()[:, :, None, :])
    copy_rows_(ssm_pool, slots, state)
    y = (grouped * C.float()[:, :, None, :]).sum(-1).view(Bsz, H, P)  # [B, H, P]
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y


def ssd_varlen_torch(x, dt, A, B, C, chunk_size, D, seqs: VarlenSeqs, initial_states, with_state=()):
    del with_state  # the reference takes every sequence's initial state (zeros for fresh ones)
    return ssd_varlen_ref(x, dt, A, B, C, chunk_size, D, seqs, initial_states)


def _with_sdpa_backends(attention: Callable[..., torch.Tensor], device: str) -> tuple[Callable[..., torch.Tensor], str]:
    """`attention` run inside sdpa_kernel(the device's backends); and its description for the log."""
    backends = sdpa_backends_for(device)
    context = sdpa_context(backends)

    def attention_with_backends(q, k_slots, v_slots, plan, scale):
        with context():
            return attention(q, k_slots, v_slots, plan, scale)

    return attention_with_backends, describe(backends)


@dataclass(frozen=True)
class KernelSet:
    """The functions layers call; signatures are those of the torch references.

    ssd_scan(x, dt, A, B, C, chunk_size, D, seqs, initial_states, with_state) -> (y, final_states)
        ssd_varlen.ssd_varlen_ref; with_state: the sequences whose initial state is not zero
    conv1d(x, conv_states, weight, bias, seqs, activation) -> (y, final_states)
        ssd_varlen.causal_conv1d_varlen_ref
    conv1d_update(x, conv_pool, slots, weight, bias, activation) -> y (pool in place)  ssd.conv1d_update_ref
    state_update(ssm_pool, slots, x, dt, A, B, C, D) -> y (pool in place)    ssd.selective_state_update_ref
    attention(q, k_slots, v_slots, plan, scale) -> out                                 paged_attention_ref
    attention_backend: what `attention` runs, for the start-up log and tests ("sdpa[FLASH_ATTENTION,MATH]",
        "flash_attn.flash_attn_varlen_func")
    """

    name: str
    ssd_scan: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    conv1d: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    conv1d_update: Callable[..., torch.Tensor]
    state_update: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    attention_backend: str = ""


def _torch_kernels(device: str) -> KernelSet:
    attention, backend = _with_sdpa_backends(paged_attention_ref, device)
    return KernelSet("torch", ssd_varlen_torch, causal_conv1d_varlen_ref, conv1d_update_torch, state_update_torch,
                     attention, backend)


TORCH_KERNELS = _torch_kernels("cpu")
TORCH_CUDA_KERNELS = _torch_kernels("cuda")  # never cuDNN SDPA: it re-plans for every new sequence length


def missing_cuda_packages() -> list[str]:
    return [name for name in CUDA_PACKAGES if importlib.util.find_spec(name) is None]


def _cuda_kernels() -> KernelSet:
    ssd_combined = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    ssu = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    conv = importlib.import_module("causal_conv1d")
    flash = importlib.import_module("flash_attn")

    def ssd_scan(x, dt, A, B, C, chunk_size, D, seqs, initial_states, with_state=()):
        # mamba_ssm's varlen mode takes one initial state per batch row, not per sequence: scan from
        # zeros with seq_idx, then add the initial states' (linear) contribution
        y, final = ssd_combined.mamba_chunk_scan_combined(
            x[None], dt[None], A, B[None], C[None], chunk_size, D=D,
            seq_idx=seqs.seq_idx[None], cu_seqlens=seqs.cu_seqlens, return_varlen_states=True,
        )  # y [1, T, H, P], final [n, H, P, N]
        y, final = y[0].float(), final.float()
        add_initial_state_contribution(y, final, dt, A, C, seqs, initial_states, list(with_state))
        return y, final

    def conv1d(x, conv_states, weight, bias, seqs, activation="silu"):
        # each sequence's state columns go in front of its tokens (causal_conv1d_fn takes no initial
        # states together with seq_idx); see varlen.ConvLayout
        channels, K = weight.shape
        layout = seqs.conv_layout(K)
        states = conv_states.to(x.dtype).transpose(1, 2).reshape(-1, channels)  # [n*(K-1), C_]
        ext = torch.cat([states, x])[layout.ext_rows]  # [E, C_]
        y = conv.causal_conv1d_fn(
            ext.t()[None], weight, bias, seq_idx=layout.ext_seq_idx[None], activation=activation
        )  # [1, C_, E] (channel-last)
        return y[0].t()[layout.out_cols + K - 1], ext[layout.final_rows].transpose(1, 2)

    def conv1d_update(x, conv_pool, slots, weight, bias, activation="silu"):
        return conv.causal_conv1d_update(
            x, conv_pool, weight, bias, activation=activation, conv_state_indices=slots.to(torch.int32)
        )  # [B, C_]

    def state_update(ssm_pool, slots, x, dt, A, B, C, D=None):
        P, N = x.shape[-1], ssm_pool.shape[-1]
        return ssu.selective_state_update(
            ssm_pool,
            x,
            dt[..., None].expand(-1, -1, P),
            A[:, None, None].expand(-1, P, N),
            B,
            C,
            D=None if D is None else D[:, None].expand(-1, P),
            dt_softplus=False,
            state_batch_indices=slots,
        )  # [B, H, P]

    def attention(q, k_slots, v_slots, plan, scale):
        # flash-attn takes fp16/bf16 only: a float32 model attends in bf16 and casts back. Its paged
        # mode needs pages of 256 tokens; ours are smaller, so keys are gathered packed (cu_seqlens_k).
        dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        k, v = k_slots[plan.packed_read_slots], v_slots[plan.packed_read_slots]  # [sum S_i, Hkv, hd]
        out = flash.flash_attn_varlen_func(
            q.to(dtype), k.to(dtype), v.to(dtype), plan.cu_seqlens_q, plan.cu_seqlens_k,
            max(plan.num_new), max(plan.num_total), softmax_scale=scale, causal=True,
        )  # [T, H, hd]; causal is bottom-right aligned when S_i > new_i
        return out.to(q.dtype)

    return KernelSet("cuda", ssd_scan, conv1d, conv1d_update, state_update, attention,
                     "flash_attn.flash_attn_varlen_func")


def select_kernels(choice: str = "auto", device: torch.device | str = "cpu") -> KernelSet:
    """Resolve a kernel choice for a model on `device`; logs the result once."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {choice!r}")
    device = torch.device(device)
    missing = missing_cuda_packages()
    if choice == "cuda":
        if missing:
            raise KernelUnavailableError(
                f"kernels='cuda' needs {', '.join(missing)} (pip install '.[cuda]'), or use kernels='torch'"
            )
        if device.type != "cuda":
            raise KernelUnavailableError(f"kernels='cuda' needs the model on a CUDA device, not {device}")
        kernels, why = _cuda_kernels(), "requested"
    elif choice == "torch":
        kernels, why = _torch_for(device), "requested"
    elif device.type == "cuda" and not missing:
        kernels, why = _cuda_kernels(), "auto: CUDA device and all kernel packages present"
    else:
        kernels = _torch_for(device)
        why = f"auto: device {device}" if device.type != "cuda" else f"auto: missing {', '.join(missing)}"
    key = (choice, str(device), kernels.name)
    if key not in _logged:
        _logged.add(key)
        log.info("model kernels: %s (%s); attention: %s", kernels.name, why, kernels.attention_backend)
    return kernels


def _torch_for(device: torch.device) -> KernelSet:
    return TORCH_CUDA_KERNELS if device.type == "cuda" else TORCH_KERNELS
