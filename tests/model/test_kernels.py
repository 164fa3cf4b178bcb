"""Kernel selection, and (GPU only) the CUDA kernels against the torch references."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from workers.model import kernels as kmod
from workers.model.errors import KernelUnavailableError
from workers.model.forward_batch import ForwardBatch, SeqChunk
from workers.model.kernels import TORCH_KERNELS, attention_ref, missing_cuda_packages, select_kernels
from workers.model.paged_plan import PagedPlan
from workers.model.ssd import conv1d_update_ref, selective_state_update_ref
from workers.model.varlen import VarlenSeqs

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
    assert lines == ["model kernels: torch (requested); attention: sdpa[FLASH_ATTENTION,MATH]",
                     "model kernels: torch (auto: device cpu); attention: sdpa[FLASH_ATTENTION,MATH]"]


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


def test_torch_state_update_equals_reference():
    g = torch.Generator().manual_seed(4)
    Bsz, H, P, G, N = 5, 6, 4, 3, 8
    pool = torch.randn(9, H, P, N, generator=g)
    slots = torch.tensor([7, 0, 3, 8, 2])
    x, dt = torch.randn(Bsz, H, P, generator=g), torch.rand(Bsz, H, generator=g)
    A, D = -torch.rand(H, generator=g), torch.randn(H, generator=g)
    B, C = torch.randn(Bsz, G, N, generator=g), torch.randn(Bsz, G, N, generator=g)
    ref_pool, before = pool.clone(), pool.clone()
    y = TORCH_KERNELS.state_update(pool, slots, x, dt, A, B, C, D)
    torch.testing.assert_close(y, selective_state_update_ref(ref_pool, slots, x, dt, A, B, C, D), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-6, rtol=1e-6)
    assert not torch.equal(pool[slots], before[slots])  # the states really advanced
    others = [s for s in range(9) if s not in slots.tolist()]
    assert torch.equal(pool[others], before[others])  # and no other slot was touched


@pytest.mark.parametrize("bias", [True, False])
def test_torch_conv_update_equals_reference(bias):
    g = torch.Generator().manual_seed(5)
    Bsz, channels, K = 4, 12, 4
    pool = torch.randn(7, channels, K - 1, generator=g)
    slots = torch.tensor([6, 0, 3, 2])
    x, weight = torch.randn(Bsz, channels, generator=g), torch.randn(channels, K, generator=g)
    b = torch.randn(channels, generator=g) if bias else None
    ref_pool, before = pool.clone(), pool.clone()
    y = TORCH_KERNELS.conv1d_update(x, pool, slots, weight, b, "silu")
    torch.testing.assert_close(y, conv1d_update_ref(x, ref_pool, slots, weight, b, "silu"), atol=1e-6, rtol=1e-5)
    assert torch.equal(pool, ref_pool)  # the shifted window is copied, not computed: bit-equal
    assert torch.equal(pool[slots][:, :, :-1], before[slots][:, :, 1:]) and torch.equal(pool[slots][:, :, -1], x)
    others = [s for s in range(7) if s not in slots.tolist()]
    assert torch.equal(pool[others], before[others])


def test_paged_attention_ref_equals_attention_ref_per_chunk():
    """Grouped, padded SDPA over a paged pool == attention_ref on each chunk's own gathered keys."""
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(40, 16, 2, 8, generator=g) for _ in range(2))
    table = torch.randperm(40, generator=g)
    chunks = (SeqChunk(0, 40, table[:3], 0), SeqChunk(30, 1, table[3:5], 1), SeqChunk(20, 4, table[5:7], 2),
              SeqChunk(200, 1, table[7:20], 3), SeqChunk(5, 300, table[20:40], 4), SeqChunk(0, 1, table[:1], 5))
    T = sum(c.num_new_tokens for c in chunks)
    plan = PagedPlan.build(ForwardBatch(torch.zeros(T, dtype=torch.long), chunks), 16, "cpu")
    assert len(plan.sdpa_groups) >= 2  # the long prefill is kept apart: padding is really exercised
    q = torch.randn(T, 4, 8, generator=g)
    k_slots, v_slots = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    out = TORCH_KERNELS.attention(q, k_slots, v_slots, plan, 8**-0.5)
    row = 0
    for c in chunks:
        pos = torch.arange(c.num_total_tokens)
        slots = c.block_table[pos // 16] * 16 + pos % 16
        want = attention_ref(q[row : row + c.num_new_tokens], k_slots[slots], v_slots[slots], 8**-0.5)
        torch.testing.assert_close(out[row : row + c.num_new_tokens], want, atol=1e-6, rtol=1e-5)
        row += c.num_new_tokens


@pytest.mark.gpu
@needs_cuda_kernels
def test_cuda_kernels_match_torch_references():
    """Varlen calls over packed sequences (seq_idx / cu_seqlens), some with initial states, some fresh."""
    cuda = select_kernels("cuda", "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = (150, 7, 64, 1)
    seqs = VarlenSeqs(lengths, torch.device("cuda"))
    L, H, P, G, N = sum(lengths), 8, 64, 2, 64
    x = torch.randn(L, H, P, device="cuda", generator=g)
    dt = F.softplus(torch.randn(L, H, device="cuda", generator=g) - 2)
    A = -torch.rand(H, device="cuda", generator=g) - 0.5
    B, C = (torch.randn(L, G, N, device="cuda", generator=g) for _ in range(2))
    D, h0 = torch.randn(H, device="cuda", generator=g), torch.randn(4, H, P, N, device="cuda", generator=g)
    h0[1] = 0  # a fresh sequence
    y_ref, s_ref = TORCH_KERNELS.ssd_scan(x, dt, A, B, C, 64, D, seqs, h0, (0, 2, 3))
    y, s = cuda.ssd_scan(x, dt, A, B, C, 64, D, seqs, h0, (0, 2, 3))
    torch.testing.assert_close(y.float(), y_ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(s.float(), s_ref, atol=2e-2, rtol=1e-2)
    xc = torch.randn(L, 96, device="cuda", generator=g)
    w, b = torch.randn(96, 4, device="cuda", generator=g), torch.randn(96, device="cuda", generator=g)
    c0 = torch.randn(4, 96, 3, device="cuda", generator=g)
    c0[1] = 0
    for got, want in zip(cuda.conv1d(xc, c0, w, b, seqs, "silu"), TORCH_KERNELS.conv1d(xc, c0, w, b, seqs, "silu")):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
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
    torch.testing.assert_close(
        cuda.conv1d_update(xc[:2], conv, slots, w, b),
        TORCH_KERNELS.conv1d_update(xc[:2], conv_ref, slots, w, b),
        atol=1e-3,
        rtol=1e-3,
    )
    torch.testing.assert_close(conv, conv_ref)
    # paged attention: a prefill chunk, a decode and a verify chunk over one scrambled pool
    k_cache, v_cache = (torch.randn(12, 16, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(12, device="cuda")
    chunks = (SeqChunk(0, 40, table[:3], 0), SeqChunk(30, 1, table[3:5], 1), SeqChunk(20, 4, table[5:7], 2))
    plan = PagedPlan.build(ForwardBatch(torch.zeros(45, dtype=torch.long), chunks), 16, "cuda")
    q = torch.randn(45, 4, 64, device="cuda", dtype=torch.bfloat16)
    k_slots, v_slots = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    torch.testing.assert_close(
        cuda.attention(q, k_slots, v_slots, plan, 0.125).float(),
        TORCH_KERNELS.attention(q.float(), k_slots.float(), v_slots.float(), plan, 0.125),
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
