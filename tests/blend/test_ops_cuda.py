"""CUDA: FlexAttention against the dense float64 reference, blend through ops at ratio 1.0 =
full prefill over the staged host→GPU pipeline. The vLLM worker's source (gpu, host and disk
tiers; the compute stream waiting on a slow copy): ``tests/cluster/vllm/test_worker_source_cuda.py``.
The kernels alone: ``tests/blend/kernels/test_kernels_cuda.py``. Skipped without a GPU.

Tolerances: bf16 operands give ‖out − ref‖/‖ref‖ between 1e-3 and 1e-2 against float64
(flash/flex accumulate in float32, round P to bf16); float32 models agree to 1e-4
(factories). Copies are bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from blend import engine as engine_module
from blend import flex_rows, ops
from blend.attention import dense_attention_reference
from blend.engine import BlendEngine
from tests.factories import F32_TOL, all_hit_plan, fill_tiers, ops_adapter, random_chunks
from tiers.gpu import GpuTier
from tiers.host import HostTier
from tiers.staging import StagedSource

pytestmark = [pytest.mark.gpu, pytest.mark.unit]
CUDA = torch.device("cuda")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return float((got.double() - want.double()).norm() / want.double().norm())










@pytest.mark.parametrize("num_keys,num_q,ordered", [(4096, 700, True), (1000, 1000, True), (2050, 77, False)])
def test_flex_selected_row_attention_matches_dense_reference(num_keys, num_q, ordered):
    g = torch.Generator(device=CUDA).manual_seed(num_keys)
    q = torch.randn(num_q, 32, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    k = torch.randn(num_keys, 8, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    v = torch.randn(num_keys, 8, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    pos = torch.randperm(num_keys, device=CUDA, generator=g)[:num_q]
    if ordered:
        pos = pos.sort().values
    got = ops.selected_row_attention(q, pos, k, v, None, 128 ** -0.5)
    assert not flex_rows._FLEX_BROKEN, flex_rows._FLEX_BROKEN  # the fast path ran
    assert rel_err(got, dense_attention_reference(q, k, v, pos, 128 ** -0.5)) < 1e-2
    ref = ops.selected_row_attention_reference(q, pos, k, v, None, 128 ** -0.5)
    assert rel_err(got, ref) < 1e-2
    rows = ops.prepare_rows(pos, num_keys)  # built once per request, reused by every layer
    assert torch.equal(ops.selected_row_attention(q, pos, k, v, None, 128 ** -0.5, rows=rows), got)


def test_attend_causal_path_matches_reference():
    g = torch.Generator(device=CUDA).manual_seed(3)
    q = torch.randn(1500, 32, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1500, 8, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    v = torch.randn(1500, 8, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    assert rel_err(ops.causal_attention(q, k, v, None, 128 ** -0.5), dense_attention_reference(q, k, v, None, 128 ** -0.5)) < 1e-2


def _setup(num_chunks=4, tokens=160):
    adapter = ops_adapter(CUDA, hidden=128, heads=4, kv_heads=2, vocab=256)  # head_dim 32
    chunks = random_chunks(num_chunks, tokens, vocab=256, low=4)
    host, gpu = HostTier(1 << 28), GpuTier(1 << 28, CUDA)
    fill_tiers(BlendEngine(adapter), chunks, [host], [gpu])
    return adapter, chunks, host, gpu


def test_blend_through_ops_ratio_one_is_full_prefill(monkeypatch):
    adapter, chunks, host, gpu = _setup()
    monkeypatch.setattr(engine_module, "causal_attention", ops.causal_attention)
    plan = all_hit_plan(chunks, 1.0)
    src = StagedSource(host, CUDA)
    src.lookup([s.key for s in plan.hit_segments])
    got = BlendEngine(adapter, src).blend(plan)
    full = BlendEngine(adapter).prefill(list(plan.token_ids))
    assert got.counters.full_prefill_reason is None
    torch.testing.assert_close(got.logits, full.logits, **F32_TOL)
    for a, b in zip(got.kv, full.kv, strict=False):
        torch.testing.assert_close(a, b, **F32_TOL)
    # ratio 0.15: layers up to the check layer are full prefill's
    part = BlendEngine(adapter, src).blend(all_hit_plan(chunks, 0.15))
    for layer in range(2):
        torch.testing.assert_close(part.kv[layer], full.kv[layer], **F32_TOL)
    assert src.transfer_stats().num_bytes > 0
    src.close()


def test_prepared_flex_shapes_serve_other_row_counts_without_compiling(monkeypatch):
    """After :func:`blend.ops.prepare_flex` a call with a row count never compiled, gradients
    off as in a request, pads up to a compiled shape: dynamo builds no new graph, and the
    result equals the dense reference, also with NaN in the whole pad tiles' queries (the
    compiled kernel multiplies them with no key: ``flex_rows._padded_rows`` leaves them unwritten)."""
    from torch._dynamo.utils import counters

    from blend import flex_shapes

    flex_shapes.reset()
    try:
        done = ops.prepare_flex(1500, 4, 2, 64, torch.float32, torch.device("cuda"), 0.125)
        assert done["shapes"] >= 1 and done["max_keys"] == ops.shape_bucket(1500)
        g = torch.Generator().manual_seed(9)
        q = torch.randn(300, 4, 64, generator=g).cuda()
        k, v = (torch.randn(1500, 2, 64, generator=g).cuda() for _ in range(2))
        pos = torch.randperm(1500, generator=g)[:300].sort().values.cuda()
        graphs = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            rows = ops.prepare_rows(pos, 1500)
            got = ops.causal_attention(q, k, v, pos, 0.125, rows)
        assert rows.q_pos_padded.numel() == ops.shape_bucket(1500)  # not its own 384
        assert counters["stats"]["unique_graphs"] == graphs
        want = dense_attention_reference(q, k, v, pos, 0.125)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        padded_rows = flex_rows._padded_rows

        def nan_tiles(q, length):
            out = padded_rows(q, length)
            out[-(-q.shape[0] // ops.FLEX_BLOCK) * ops.FLEX_BLOCK:] = float("nan")
            return out

        monkeypatch.setattr(flex_rows, "_padded_rows", nan_tiles)
        with torch.no_grad():
            got = ops.causal_attention(q, k, v, pos, 0.125, rows)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    finally:
        flex_shapes.reset()
