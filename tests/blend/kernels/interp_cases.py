"""Triton kernels against their plain-torch references at tiny shapes, on the CPU.

Run by ``test_kernels_interpret.py`` in a subprocess with ``TRITON_INTERPRET=1`` (Triton
picks its interpreter when it is first imported, so these cannot share a process with tests
that import Triton normally). Not collected on its own (no ``test_`` prefix).

Tolerances: the kernels and the references both rotate / accumulate in float32 and round
once to the storage dtype; differences are float32 rounding (~1e-6 relative) before that,
so results agree within one ulp of the storage dtype (bf16: 2**-8 relative) and the paged
copies are bit-exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from blend.kernels import interpreting
from blend.kernels.deviation import deviation_reference, deviation_triton
from blend.kernels.paged import gather_reference, gather_triton, scatter_reference, scatter_triton
from blend.kernels.rope import rerotate_triton_
from blend.rope import rerotate_k

# the child pytest checks lanes too (tests/conftest.py): these cases start no process
pytestmark = pytest.mark.unit

# float32: the reference rounds the angle (up to ~500 rad here) to float32 before cos/sin
# (ulp 3e-5 rad), the kernel rounds cos/sin of the float64 angle: 1e-4 covers both.
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2**-7, atol=2**-7),
       torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return (1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()


def rope_f64(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE (neox layout) entirely in float64: the truth for re-rotation."""
    angle = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_interpreter_is_on():
    assert interpreting(), "run with TRITON_INTERPRET=1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,num_heads,head_dim", [(1, 1, 4), (13, 3, 16), (40, 2, 32)])
def test_rerotate_matches_reference(dtype, num_tokens, num_heads, head_dim):
    g = torch.Generator().manual_seed(num_tokens * 7 + head_dim)
    k = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    # small positions: the reference rounds the angle to float32 before cos/sin, the kernel
    # after; below 512 the angle's float32 ulp (<= 3e-5 rad) stays under the dtype's tolerance
    frm = torch.randint(0, 300, (num_tokens,), generator=g)
    to = torch.randint(0, 500, (num_tokens,), generator=g)
    inv = _inv_freq(head_dim)
    want = rerotate_k(k, frm, to, inv)
    got = k.clone()
    assert rerotate_triton_(got, frm, to, inv) is got
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rerotate_moves_k_to_new_position():
    """Re-rotated K equals K rotated at the new position directly (float64 truth)."""
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(24, 2, 16, generator=g, dtype=torch.float64)
    frm, to = torch.arange(24), torch.arange(24) + 1000
    inv = _inv_freq(16)
    stored = rope_f64(raw, frm, inv).float()
    rerotate_triton_(stored, frm, to, inv)
    torch.testing.assert_close(stored.double(), rope_f64(raw, to, inv), rtol=1e-5, atol=1e-5)


def test_rerotate_strided_heads_and_errors():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(10, 4, 16, generator=g)
    view = base[:, 1:3]  # non-contiguous in H, unit stride in D
    frm, to = torch.arange(10), torch.arange(10) + 7
    want = rerotate_k(view, frm, to, _inv_freq(16))
    rerotate_triton_(view, frm, to, _inv_freq(16))
    torch.testing.assert_close(base[:, 1:3], want)
    with pytest.raises(ValueError):
        rerotate_triton_(torch.randn(10, 2, 16), frm[:9], to, _inv_freq(16))
    with pytest.raises(ValueError):
        rerotate_triton_(torch.randn(10, 2, 12), frm, to, _inv_freq(12))  # D/2 = 6
    with pytest.raises(TypeError):
        rerotate_triton_(torch.randn(10, 2, 16), frm.float(), to, _inv_freq(16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indexed", [False, True])
def test_deviation_matches_reference(dtype, indexed):
    g = torch.Generator().manual_seed(11)
    fresh = torch.randn(37, 3, 16, generator=g).to(dtype)
    cached = torch.randn(80, 3, 16, generator=g).to(dtype)
    if indexed:
        fi = torch.randperm(37, generator=g)[:29]
        ci = torch.randperm(80, generator=g)[:29]
        want, got = deviation_reference(fresh, cached, fi, ci), deviation_triton(fresh, cached, fi, ci)
    else:
        want, got = deviation_reference(fresh, cached[:37]), deviation_triton(fresh, cached[:37])
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_deviation_rejects_bad_indices():
    fresh, cached = torch.randn(5, 2, 8), torch.randn(9, 2, 8)
    with pytest.raises(ValueError):
        deviation_triton(fresh, cached, torch.arange(5), torch.tensor([0, 1, 2, 3, 9]))
    with pytest.raises(ValueError):
        deviation_triton(fresh, cached, torch.arange(4), torch.arange(5))
    with pytest.raises(TypeError):
        deviation_triton(fresh, cached, torch.arange(5).float(), torch.arange(5))


@pytest.mark.parametrize("layout,shape", [("flash_attn", (2, 6, 4, 2, 8)), ("flashinfer", (6, 2, 4, 2, 8))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_gather_scatter_bit_exact(layout, shape, dtype):
    g = torch.Generator().manual_seed(17)
    cache = torch.randn(shape, generator=g).to(dtype)
    slots = torch.randperm(24, generator=g)[:11]
    assert torch.equal(gather_triton(cache, layout, slots), gather_reference(cache, layout, slots))
    kv = torch.randn(2, 11, 2, 8, generator=g).to(dtype)
    a, b = cache.clone(), cache.clone()
    scatter_triton(a, layout, kv, slots)
    scatter_reference(b, layout, kv, slots)
    assert torch.equal(a, b)
    assert torch.equal(gather_triton(a, layout, slots), kv)  # round trip


def test_paged_rejects_out_of_range_and_bad_shapes():
    cache = torch.zeros(2, 3, 4, 2, 8)
    with pytest.raises(ValueError, match="outside"):
        gather_triton(cache, "flash_attn", torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="outside"):
        scatter_triton(cache, "flash_attn", torch.zeros(2, 1, 2, 8), torch.tensor([-1]))
    with pytest.raises(ValueError):
        scatter_triton(cache, "flash_attn", torch.zeros(2, 2, 2, 8), torch.tensor([0]))
    with pytest.raises(ValueError):
        gather_triton(cache, "packed", torch.tensor([0]))
    with pytest.raises(TypeError):
        gather_triton(cache, "flash_attn", torch.tensor([0.0]))
    assert math.isclose(float(gather_triton(cache, "flash_attn", torch.tensor([0], dtype=torch.int32)).sum()), 0.0)


@pytest.mark.parametrize("num_q,num_kv,block,ordered", [(300, 1000, 16, True), (5, 64, 16, False),
                                                        (128, 130, 32, True), (40, 2000, 64, False)])
def test_block_tables_match_reference(num_q, num_kv, block, ordered):
    from blend.kernels.blockmask import block_tables_reference, block_tables_triton

    g = torch.Generator().manual_seed(num_q + num_kv)
    pos = torch.randperm(num_kv, generator=g)[:num_q]
    if ordered:
        pos = pos.sort().values
    pad = -(-num_q // block) * block
    padded = torch.cat((pos, pos[-1:].expand(pad - num_q))).contiguous()
    got = block_tables_triton(padded, num_kv, block)
    want = block_tables_reference(padded, num_kv, block)
    for a, b in zip(got, want, strict=False):
        assert torch.equal(a, b)
