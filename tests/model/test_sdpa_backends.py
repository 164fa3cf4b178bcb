"""The torch attention path runs SDPA with an explicit backend list per device, never cuDNN."""

import pytest
import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode

import workers.model.kernels as kmod
from workers.model.forward_batch import ForwardBatch, SeqChunk
from workers.model.kernels import TORCH_CUDA_KERNELS, TORCH_KERNELS, select_kernels
from workers.model.paged_plan import PagedPlan
from workers.model.sdpa_backends import sdpa_backends_for


def _inputs():
    g = torch.Generator().manual_seed(0)
    chunks = (SeqChunk(30, 1, torch.tensor([0, 1]), 0), SeqChunk(0, 5, torch.tensor([2]), 1))
    plan = PagedPlan.build(ForwardBatch(torch.zeros(6, dtype=torch.long), chunks), 16, "cpu")
    q, k, v = torch.randn(6, 4, 8, generator=g), torch.randn(48, 2, 8, generator=g), torch.randn(48, 2, 8, generator=g)
    return q, k, v, plan


def _flags() -> dict[str, bool]:
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(), "math": b.math_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled()}


def test_backend_lists_never_hold_cudnn():
    assert sdpa_backends_for("cuda") == (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    assert sdpa_backends_for("cuda:1") == sdpa_backends_for("cuda")
    assert sdpa_backends_for("cpu") == (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)
    assert select_kernels("torch", "cuda") is TORCH_CUDA_KERNELS  # no device touched: a choice only
    assert TORCH_CUDA_KERNELS.attention_backend == "sdpa[FLASH_ATTENTION,EFFICIENT_ATTENTION,MATH]"


@pytest.mark.parametrize(("kernels", "want"), [
    (TORCH_KERNELS, {"flash": True, "efficient": False, "math": True, "cudnn": False}),
    (TORCH_CUDA_KERNELS, {"flash": True, "efficient": True, "math": True, "cudnn": False}),
])
def test_every_sdpa_call_runs_under_the_chosen_backends(kernels, want, monkeypatch):
    """What SDPA may pick is what the kernel set says, at every call (cuDNN disabled inside), and the
    process-wide defaults are back afterwards."""
    seen = []
    real = kmod.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(_flags())
        return real(*args, **kwargs)

    before = _flags()
    monkeypatch.setattr(kmod.F, "scaled_dot_product_attention", spy)
    kernels.attention(*_inputs(), 8**-0.5)
    assert len(seen) == len(_inputs()[3].sdpa_groups) >= 1
    assert all(flags == want for flags in seen)
    assert _flags() == before


def test_cpu_attention_runs_the_flash_kernel():
    """On the CPU the op that runs is SDPA's flash kernel (the first listed backend), not the math one."""
    ops = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v, plan = _inputs()
    with Names():
        TORCH_KERNELS.attention(q, k, v, plan, 8**-0.5)
    sdpa = [name for name in ops if "scaled_dot_product" in name]
    assert sdpa and set(sdpa) <= {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu"}
    assert "_scaled_dot_product_flash_attention_for_cpu" in sdpa
