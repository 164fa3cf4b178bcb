"""Which SDPA kernels the torch attention path may use, chosen per device and logged, never left to
PyTorch's default order.

On an H200 PyTorch's default SDPA backend is cuDNN, which builds a new execution plan for every new
sequence length: on the decode path that is every step (~50 ms of host time per call, 82% of a decode
step's host time in the GPU engine issue). The torch path therefore runs every SDPA call inside
`sdpa_kernel(backends)` with an explicit list, in priority order:

    cuda  FLASH_ATTENTION (fp16/bf16, no mask: the unpadded groups), EFFICIENT_ATTENTION (masks, fp32),
          MATH (last resort for shapes neither takes; it plans nothing either)
    cpu   FLASH_ATTENTION (PyTorch's CPU flash kernel, masks allowed), MATH

CUDNN_ATTENTION is never listed. (`kernels: cuda` does not use SDPA at all: flash-attn's varlen kernel.)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
CPU_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)


def sdpa_backends_for(device: torch.device | str) -> tuple[SDPBackend, ...]:
    """The SDPA backends the torch attention path allows on `device`, in priority order."""
    return CUDA_SDPA_BACKENDS if torch.device(device).type == "cuda" else CPU_SDPA_BACKENDS


def describe(backends: tuple[SDPBackend, ...]) -> str:
    return "sdpa[" + ",".join(b.name for b in backends) + "]"


def sdpa_context(backends: tuple[SDPBackend, ...]) -> Callable[[], AbstractContextManager]:
    """A factory of the context every SDPA call of the torch path runs in (`sdpa_kernel(backends)`)."""
    backends_list = list(backends)

    def context() -> AbstractContextManager:
        return sdpa_kernel(backends_list)

    return context
