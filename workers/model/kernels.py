"""Kernel choice: `auto | torch | cuda` -> a `KernelSet` of four functions the layers call.

- `torch`: the references in ssd.py plus torch SDPA. Runs anywhere.
- `cuda`:  mamba_ssm (SSD scan, selective state update), causal_conv1d (conv update), flash_attn.
           A missing package or no CUDA device raises KernelUnavailableError; never a silent fallback.
- `auto`:  `cuda` if every package is installed AND the model lives on a CUDA device, else `torch`.

The choice is logged once per (choice, device). Prefill conv always uses the torch reference (a depthwise
conv is cheap; the state bookkeeping is ours). The CUDA wrappers are kept thin and only run on GPU tests.
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
from workers.model.ssd import conv1d_update_ref, selective_state_update_ref, ssd_chunk_scan_ref

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


@dataclass(frozen=True)
class KernelSet:
    """The functions layers call; signatures are those of the torch references.

    ssd_scan(x, dt, A, B, C, chunk_size, D, initial_state) -> (y, final_state)        ssd.ssd_chunk_scan_ref
    conv1d_update(x, conv_pool, slots, weight, bias, activation) -> y (pool in place)  ssd.conv1d_update_ref
    state_update(ssm_pool, slots, x, dt, A, B, C, D) -> y (pool in place)    ssd.selective_state_update_ref
    attention(q, k, v, scale) -> out                                                   attention_ref
    """

    name: str
    ssd_scan: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    conv1d_update: Callable[..., torch.Tensor]
    state_update: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]


TORCH_KERNELS = KernelSet(
    "torch", ssd_chunk_scan_ref, conv1d_update_ref, selective_state_update_ref, attention_ref
)


def missing_cuda_packages() -> list[str]:
    return [name for name in CUDA_PACKAGES if importlib.util.find_spec(name) is None]


def _cuda_kernels() -> KernelSet:
    ssd_combined = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    ssu = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    conv = importlib.import_module("causal_conv1d")
    flash = importlib.import_module("flash_attn")

    def ssd_scan(x, dt, A, B, C, chunk_size, D=None, initial_state=None):
        init = None if initial_state is None else initial_state[None].float()
        y, final = ssd_combined.mamba_chunk_scan_combined(
            x[None],
            dt[None],
            A,
            B[None],
            C[None],
            chunk_size,
            D=D,
            initial_states=init,
            return_final_states=True,
        )  # y [1, L, H, P], final [1, H, P, N]
        return y[0], final[0]

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

    def attention(q, k, v, scale):
        # flash-attn takes fp16/bf16 only: a float32 model attends in bf16 and casts back
        dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        q16, k16, v16 = (t.to(dtype)[None] for t in (q, k, v))
        return flash.flash_attn_func(q16, k16, v16, softmax_scale=scale, causal=True)[0].to(q.dtype)

    return KernelSet("cuda", ssd_scan, conv1d_update, state_update, attention)


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
        kernels, why = TORCH_KERNELS, "requested"
    elif device.type == "cuda" and not missing:
        kernels, why = _cuda_kernels(), "auto: CUDA device and all kernel packages present"
    else:
        kernels = TORCH_KERNELS
        why = f"auto: device {device}" if device.type != "cuda" else f"auto: missing {', '.join(missing)}"
    key = (choice, str(device), kernels.name)
    if key not in _logged:
        _logged.add(key)
        log.info("model kernels: %s (%s)", kernels.name, why)
    return kernels
