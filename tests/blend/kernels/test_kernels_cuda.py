"""CUDA: every Triton kernel against its plain-torch reference on random inputs, at real
sizes (``tests/blend/kernels/interp_cases.py`` runs them at tiny sizes under Triton's
interpreter on the CPU). Skipped without a GPU.

Tolerances: re-rotation rounds angles up to 32K rad to float32 in the reference (ulp 2e-3
rad), so results agree to a few 1e-3 relative; deviation scores to 1e-2; the paged copies and
block tables are bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from blend import ops
from blend.kernels.deviation import deviation_reference, deviation_triton
from blend.kernels.paged import gather_reference, gather_triton, scatter_reference, scatter_triton
from blend.kernels.rope import rerotate_reference_, rerotate_triton_

pytestmark = [pytest.mark.gpu, pytest.mark.unit]
CUDA = torch.device("cuda")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return float((got.double() - want.double()).norm() / want.double().norm())


def _inv_freq(head_dim=128, theta=500000.0):
    return (1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rerotate_kernel_matches_reference(dtype):
    for seed, (t, h) in enumerate([(4099, 8), (1, 8), (513, 3)]):
        g = torch.Generator(device=CUDA).manual_seed(seed)
        k = torch.randn(t, h, 128, device=CUDA, generator=g).to(dtype)
        frm = torch.randint(0, 512, (t,), device=CUDA, generator=g)
        to = torch.randint(0, 32768, (t,), device=CUDA, generator=g)
        want = rerotate_reference_(k.clone(), frm, to, _inv_freq())
        got = k.clone()
        assert ops.rerotate_k_(got, frm, to, _inv_freq()) is got
        # the reference rounds angles up to 32K rad to float32 first (ulp 2e-3 rad)
        assert rel_err(got, want) < (3e-3 if dtype == torch.float32 else 6e-3)
        direct = rerotate_triton_(k.clone(), frm, to, _inv_freq())
        assert torch.equal(direct, got)


@pytest.mark.parametrize("indexed", [False, True])
def test_deviation_kernel_matches_reference(indexed):
    g = torch.Generator(device=CUDA).manual_seed(1)
    fresh = torch.randn(5000, 8, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    cached = torch.randn(9000, 8, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    fi = torch.randperm(5000, device=CUDA, generator=g)[:4000] if indexed else None
    ci = torch.randperm(9000, device=CUDA, generator=g)[:4000] if indexed else None
    c = cached if indexed else cached[:5000]
    got, want = deviation_triton(fresh, c, fi, ci), deviation_reference(fresh, c, fi, ci)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(ops.deviation_scores(fresh, c, fi, ci), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("layout,shape", [("flash_attn", (2, 300, 16, 8, 128)), ("flashinfer", (300, 2, 16, 8, 128))])
def test_paged_kernels_bit_exact(layout, shape):
    g = torch.Generator(device=CUDA).manual_seed(2)
    cache = torch.randn(shape, device=CUDA, generator=g, dtype=torch.bfloat16)
    slots = torch.randperm(300 * 16, device=CUDA, generator=g)[:2000]
    assert torch.equal(gather_triton(cache, layout, slots), gather_reference(cache, layout, slots))
    assert torch.equal(ops.gather_paged(cache, layout, slots), gather_reference(cache, layout, slots))
    kv = torch.randn(2, 2000, 8, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    a, b = cache.clone(), cache.clone()
    scatter_triton(a, layout, kv, slots)
    scatter_reference(b, layout, kv, slots)
    assert torch.equal(a, b)
    c = cache.clone()
    ops.scatter_paged(c, layout, kv, slots)
    assert torch.equal(c, b)
    with pytest.raises(ValueError):
        ops.gather_paged(cache, layout, torch.tensor([300 * 16], device=CUDA))


@pytest.mark.parametrize("num_q,num_kv,ordered", [(5000, 32881, True), (700, 4153, False), (128, 100, True)])
def test_block_tables_kernel_matches_reference(num_q, num_kv, ordered):
    from blend.kernels.blockmask import block_tables_reference, block_tables_triton

    g = torch.Generator(device=CUDA).manual_seed(num_q)
    pos = torch.randperm(num_kv, device=CUDA, generator=g)[:num_q]
    if ordered:
        pos = pos.sort().values
    pad = -(-pos.numel() // 128) * 128
    padded = torch.cat((pos, pos[-1:].expand(pad - pos.numel()))).contiguous()
    for a, b in zip(block_tables_triton(padded, num_kv, 128), block_tables_reference(padded, num_kv, 128), strict=False):
        assert torch.equal(a, b)
