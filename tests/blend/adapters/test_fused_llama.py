"""FusedLlamaAdapter against HF's own forward and HFModelAdapter on tiny random Llamas (CPU).

Oracles: HF's forward (logits), :class:`HFModelAdapter` (KV, and ``qkv``/``finish_layer`` on
the same rows), and full prefill for a blend at recompute ratio 1.0. The fused adapter does
the same math with fused GEMMs and a RoPE table, so in float32 only the order of sums
differs (F32_TOL and tighter, see tests/factories.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.testing import assert_close

from blend.adapters.fused_llama import FusedLlamaAdapter
from blend.adapters.hf import HFModelAdapter
from blend.engine import BlendEngine
from cluster.cache.local import LocalCacheClient
from tests.factories import (
    F32_TOL,
    blend_prompt,
    plan_for,
    random_chunks,
    store_chunks,
    tiny_model,
)
from tiers.tier import MemoryTier

pytestmark = pytest.mark.unit

pytest.importorskip("transformers")

#: Row-level comparisons of two implementations of one layer (float32, values O(1)).
TIGHT = dict(rtol=1e-5, atol=1e-5)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _hf_last_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_prefill_matches_hf_forward_and_hf_adapter_kv(model_type):
    model = tiny_model(model_type)
    ids = random_chunks(1, 40)[0]
    want_logits = _hf_last_logits(model, ids)
    want = BlendEngine(HFModelAdapter(model, model_id="tiny")).prefill(ids)
    fused = FusedLlamaAdapter(model, model_id="tiny")
    got = BlendEngine(fused).prefill(ids)
    assert fused.spec == HFModelAdapter(model, model_id="tiny").spec
    assert _rel_err(got.logits, want_logits) < 1e-4
    assert int(got.logits.argmax()) == int(want_logits.argmax())
    assert len(got.kv) == len(want.kv) == fused.spec.num_layers
    for layer, (k_got, k_want) in enumerate(zip(got.kv, want.kv, strict=True)):
        assert_close(k_got, k_want, **TIGHT, msg=f"layer {layer}")


def test_hf_model_unchanged_and_weights_shared():
    model = tiny_model("llama", num_layers=2)
    ids = random_chunks(1, 24)[0]
    before = _hf_last_logits(model, ids)
    params = sum(p.numel() for p in model.parameters())
    fused = FusedLlamaAdapter(model)
    assert torch.equal(_hf_last_logits(model, ids), before)
    assert sum(p.numel() for p in model.parameters()) == params
    attn, wqkv = model.model.layers[0].self_attn, fused.weights[0].qkv
    assert attn.q_proj.weight.data_ptr() == wqkv.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == wqkv.untyped_storage().data_ptr()
    assert fused.inv_freq.dtype == torch.float32 and fused.inv_freq.shape == (fused.spec.head_dim // 2,)


def test_ratio_one_blend_equals_full_prefill():
    fused = FusedLlamaAdapter(tiny_model("llama"), model_id="tiny-llama")
    client = LocalCacheClient(MemoryTier(1 << 26, name="host"))
    engine = BlendEngine(fused, client)
    chunks = random_chunks(3, 24)
    store_chunks(engine, client, chunks)
    ids, spans = blend_prompt([1, 2, 3], [chunks[2], chunks[0], chunks[1]], [4, 5, 6, 9])
    res = engine.blend(plan_for(ids, spans, client, ratio=1.0))
    full = engine.prefill(ids)
    c = res.counters
    assert c.full_prefill_reason is None and c.num_hit_segments == 3 and c.reused_tokens == 72
    assert c.recomputed_tokens_per_layer == [len(ids)] * fused.spec.num_layers
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **F32_TOL)
    assert_close(res.logits, full.logits, **F32_TOL)


def test_qkv_finish_layer_and_rotate_k_on_a_row_subset():
    model = tiny_model("llama", num_layers=3)
    plain = HFModelAdapter(model)
    fused = FusedLlamaAdapter(model)
    spec, g = fused.spec, torch.Generator().manual_seed(3)
    positions = torch.tensor([3, 17, 40, 41, 100, 1023])  # not 0..T-1; up to max_position - 1
    rows, width = positions.numel(), spec.num_heads * spec.head_dim
    hidden = torch.randn(rows, spec.hidden_size, generator=g)
    residual = torch.randn(rows, spec.hidden_size, generator=g)
    attn_out = torch.randn(rows, width, generator=g)
    for layer in range(spec.num_layers):
        for res_in in (None, residual):
            got, want = fused.qkv(layer, hidden, res_in, positions), plain.qkv(layer, hidden, res_in, positions)
            for name, a, b in zip(("q", "k", "v", "residual"), got, want, strict=True):
                assert a.shape == b.shape, name
                assert_close(a, b, **TIGHT, msg=f"layer {layer} {name}")
        got, want = fused.finish_layer(layer, attn_out, residual), plain.finish_layer(layer, attn_out, residual)
        for a, b in zip(got, want, strict=True):
            assert_close(a, b, **TIGHT)
    k = fused.qkv(1, hidden, residual, positions)[1]
    to = torch.tensor([0, 5, 6, 7, 200, 300])
    k_before = k.clone()
    assert_close(fused.rotate_k(k, positions, to), plain.rotate_k(k, positions, to), **TIGHT)
    assert torch.equal(k, k_before)  # a copy
    assert_close(fused.rotate_k(k, positions, to), fused.qkv(1, hidden, residual, to)[1], **F32_TOL)
    assert_close(fused.logits(hidden, residual), plain.logits(hidden, residual), **TIGHT)


def test_bfloat16_on_cpu_close_to_hf_adapter():
    model = tiny_model("llama").to(torch.bfloat16)
    ids = random_chunks(1, 40)[0]
    want = BlendEngine(HFModelAdapter(model)).prefill(ids)
    fused = FusedLlamaAdapter(model)
    got = BlendEngine(fused).prefill(ids)
    assert fused.dtype == torch.bfloat16 and got.kv[0].dtype == torch.bfloat16
    assert got.logits.dtype == torch.float32
    assert _rel_err(got.logits, want.logits) < 3e-2
    for a, b in zip(got.kv, want.kv, strict=True):
        assert _rel_err(a, b) < 3e-2


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    model = tiny_model("llama", num_layers=2)
    ids = random_chunks(1, 16)[0]
    want = BlendEngine(FusedLlamaAdapter(model)).prefill(ids)

    def broken_compile(fn, **kw):
        def run(*args):
            raise RuntimeError("no compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    fused = FusedLlamaAdapter(model, compile=True)
    assert fused.compiled
    with caplog.at_level(logging.WARNING, logger="blend.adapters.fused_layers"):
        got = BlendEngine(fused).prefill(ids)
        BlendEngine(fused).prefill(ids)
    assert not fused.compiled
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "no compiler" in caplog.text
    assert torch.equal(got.logits, want.logits)


@pytest.mark.parametrize("kind, kw", [
    ("qwen2", {}),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),
    ("llama", {"attention_bias": True}),
])
def test_refuses_what_it_cannot_fuse(kind, kw):
    model = tiny_model(kind, num_layers=1, **kw)
    with pytest.raises(ValueError):
        FusedLlamaAdapter(model)
