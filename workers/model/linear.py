"""Linear layers for every projection of the model (same parameters and names as nn.Linear).

On CPU, float32 products of 16 or more rows go through oneDNN (`torch.ops.mkldnn._linear_pointwise`,
the op torch's own CPU compiler emits for linear layers); everything else through `F.linear` (MKL's
sgemm on CPU). Why: MKL takes its AVX2 path on AMD CPUs, oneDNN its AVX-512 one. Measured on this
machine's AMD EPYC (2 threads), [rows, 256] x [256, 1168]: 2,048 rows 5.76 -> 2.87 ms, 32 rows 142 ->
103 us; at 1-8 rows MKL stays as fast or faster (17 vs 22 us for one row), so single-sequence decode
keeps it. Both are deterministic; their float sums differ in the last bits (~1e-5 relative), as MKL's
own kernels for different row counts already do. Used only without autograd (oneDNN's op has no
backward): training goes through `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ONEDNN_MIN_ROWS = 16  # fewer rows: MKL (measured above)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_logged = False


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs on oneDNN."""
    # the row count first: a single sequence's decode step (most calls) is decided by it alone
    return (x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1] and _ONEDNN and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and not torch.is_grad_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), x [..., in] -> [..., out]; oneDNN where `uses_onednn`."""
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    global _logged
    if not _logged:
        _logged = True
        log.info("CPU linear layers: oneDNN for float32 products of %d+ rows, MKL below", ONEDNN_MIN_ROWS)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (parameters, names and init unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < ONEDNN_MIN_ROWS * x.shape[-1]:  # few rows: MKL, without a further call
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)
