"""Kernel selection, and (GPU only) the CUDA kernels against the torch references."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from workers.model import kernels as kmod
from workers.model.errors import KernelUnavailableError
from workers.model.kernels import TORCH_KERNELS, attention_ref, missing_cuda_packages, select_kernels

HAS_CUDA = torch.cuda.is_available()
needs_cuda_kernels = pytest.mark.skipif(
    not HAS_CUDA or bool(missing_cuda_packages()),
    reason="needs a CUDA device and mamba_ssm, causal_conv1d, flash_attn "
    f"(cuda={HAS_CUDA}, missing={missing_cuda_packages()})",
)


def test_torch_and_auto_on_cpu(caplog):
    kmod._logged.clear()
    with caplog.at_level(logging.INFO, logger="workers.model.kernels"):
        assert select_kernels("torch", "cpu") is TORCH_KERNELS
        assert select_kernels("auto", "cpu") is TORCH_KERNELS
        select_kernels("auto", "cpu")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["model kernels: torch (requested)", "model kernels: torch (auto: device cpu)"]


def test_cuda_without_packages_or_device_is_an_error():
    if not missing_cuda_packages() and HAS_CUDA:
        pytest.skip("CUDA kernels are available here")
    with pytest.raises(KernelUnavailableError, match="kernels='cuda' needs"):
        select_kernels("cuda", "cuda" if HAS_CUDA else "cpu")


def test_unknown_choice():
    with pytest.raises(ValueError, match="kernels must be one of"):
        select_kernels("triton")


def test_attention_ref_is_bottom_right_causal():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(3, 4, 8, generator=g),
        torch.randn(7, 2, 8, generator=g),
        torch.randn(7, 2, 8, generator=g),
    )
    out = attention_ref(q, k, v, 8**-0.5)
    for i in range(3):  # query i sits at position 4 + i
        kk, vv = k[: 5 + i].repeat_interleave(2, 1), v[: 5 + i].repeat_interleave(2, 1)
        w = torch.softmax(torch.einsum("hd,shd->hs", q[i], kk) * 8**-0.5, -1)
        torch.testing.assert_close(out[i], torch.einsum("hs,shd->hd", w, vv), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda_kernels
def test_cuda_kernels_match_torch_references():
    cuda = select_kernels("cuda", "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    L, H, P, G, N = 150, 8, 64, 2, 64
    x = torch.randn(L, H, P, device="cuda", generator=g)
    dt = F.softplus(torch.randn(L, H, device="cuda", generator=g) - 2)
    A = -torch.rand(H, device="cuda", generator=g) - 0.5
    B, C = (torch.randn(L, G, N, device="cuda", generator=g) for _ in range(2))
    D, h0 = torch.randn(H, device="cuda", generator=g), torch.randn(H, P, N, device="cuda", generator=g)
    y_ref, s_ref = TORCH_KERNELS.ssd_scan(x, dt, A, B, C, 64, D, h0)
    y, s = cuda.ssd_scan(x, dt, A, B, C, 64, D, h0)
    torch.testing.assert_close(y.float(), y_ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(s.float(), s_ref, atol=2e-2, rtol=1e-2)
    pool_ref = torch.randn(4, H, P, N, device="cuda", generator=g)
    pool = pool_ref.clone()
    slots = torch.tensor([3, 1], device="cuda")
    args = (x[:2], dt[:2], A, B[:2], C[:2], D)
    torch.testing.assert_close(
        cuda.state_update(pool, slots, *args).float(),
        TORCH_KERNELS.state_update(pool_ref, slots, *args),
        atol=1e-3,
        rtol=1e-3,
    )
    torch.testing.assert_close(pool, pool_ref, atol=1e-3, rtol=1e-3)
    conv_ref = torch.randn(4, 96, 3, device="cuda", generator=g)
    conv = conv_ref.clone()
    w, b, xc = (
        torch.randn(96, 4, device="cuda"),
        torch.randn(96, device="cuda"),
        torch.randn(2, 96, device="cuda"),
    )
    torch.testing.assert_close(
        cuda.conv1d_update(xc, conv, slots, w, b),
        TORCH_KERNELS.conv1d_update(xc, conv_ref, slots, w, b),
        atol=1e-3,
        rtol=1e-3,
    )
    torch.testing.assert_close(conv, conv_ref)
    q = torch.randn(5, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(40, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.testing.assert_close(
        cuda.attention(q, k, v, 0.125).float(),
        attention_ref(q.float(), k.float(), v.float(), 0.125),
        atol=2e-2,
        rtol=2e-2,
    )


@pytest.mark.gpu
@needs_cuda_kernels
def test_model_on_cuda_matches_cpu(tiny_dir):
    from tests.model.helpers import make_tokens, run_chunks
    from workers.model.loader import load_model

    cpu, gpu = load_model(tiny_dir, kernels="torch"), load_model(tiny_dir, device="cuda", kernels="cuda")
    ids = make_tokens(100)
    ref = run_chunks(cpu, cpu.allocate_caches(8, 16, 1), ids, [70, 1, 29], torch.arange(7), 0)
    got = run_chunks(gpu, gpu.allocate_caches(8, 16, 1), ids.cuda(), [70, 1, 29], torch.arange(7), 0)
    torch.testing.assert_close(got.cpu(), ref, atol=0.1, rtol=0)  # attention runs in bf16 on flash-attn
