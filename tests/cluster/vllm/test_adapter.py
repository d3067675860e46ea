"""The vLLM adapter of BlendModel against the HF adapter, on the same SmolLM2 weights (float32),
and the connector's CPU paged layout against vLLM's own cache-update kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blend.attention import blocked_row_attention
from blend.config import BlendConfig
from blend.planner import make_plan
from blend.segments import build_blend_prompt
from blend.selection import num_to_select, squared_deviation
from tests.cluster.vllm.helpers import generate, passage, wait_stored

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def adapters(shared_blend_llm, smollm2_path):
    from blend.adapters.hf import HFModelAdapter
    from blend.adapters.vllm import VLLMModelAdapter
    from cluster.vllm.model_hook import current_model

    return VLLMModelAdapter(current_model(), model_id="smollm2"), \
        HFModelAdapter.from_pretrained(smollm2_path, dtype=torch.float32, model_id="smollm2")


@pytest.fixture(scope="module")
def local_client(shared_blend_llm):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().client  # the process's local cache the connector stores into


def test_vllm_model_is_reached_through_the_plugin(blend_llm):
    from cluster.vllm.model_hook import KVBlendLlamaForCausalLM, current_model

    model = current_model()
    assert isinstance(model, KVBlendLlamaForCausalLM)
    # no second copy of the weights: the adapter's tensors are vLLM's parameters
    from blend.adapters.vllm import VLLMModelAdapter

    adapter = VLLMModelAdapter(model)
    assert adapter.layers[0].self_attn.qkv_proj.weight.data_ptr() == \
        model.model.layers[0].self_attn.qkv_proj.weight.data_ptr()


def test_layer_by_layer_matches_hf(adapters, tokenizer):
    vllm_a, hf_a = adapters
    assert dataclasses.replace(vllm_a.spec, model_id="") == dataclasses.replace(hf_a.spec, model_id="")
    ids = torch.tensor(tokenizer.encode(passage(7)))
    pos = torch.arange(len(ids))
    hidden = hf_a.embed(ids)
    torch.testing.assert_close(vllm_a.embed(ids), hidden)
    residual = None
    for layer in range(hf_a.spec.num_layers):
        qv, kv_, vv, rv = vllm_a.qkv(layer, hidden, residual, pos)
        q, k, v, residual = hf_a.qkv(layer, hidden, residual, pos)
        for got, want in ((qv, q), (kv_, k), (vv, v), (rv, residual)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        out = blocked_row_attention(q, k, v, None, hf_a.scale)
        hv, rv2 = vllm_a.finish_layer(layer, out, residual)
        hidden, residual = hf_a.finish_layer(layer, out, residual)
        torch.testing.assert_close(hv + rv2, hidden + residual, rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(vllm_a.logits(hidden, residual), hf_a.logits(hidden, residual),
                               rtol=1e-4, atol=2e-4)
    k = torch.randn(5, 3, 64)
    frm, to = torch.arange(5), torch.tensor([9, 40, 7, 100, 3])
    torch.testing.assert_close(vllm_a.rotate_k(k, frm, to), hf_a.rotate_k(k, frm, to))


def test_worker_blends_with_the_fused_layers_the_gpu_bench_times(blend_llm):
    """One compute path: the worker's model is FusedLlamaLayers (the class ``kvblend bench gpu``
    records as ``compute_class``) over vLLM's own parameters, not a copy."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from blend.adapters.fused_layers import FusedLlamaLayers
    from cluster.bench.gpu_harness import compute_class
    from cluster.vllm.model_hook import current_model

    model = get_kv_transfer_group().connector_worker._engine_for_worker().model  # noqa: SLF001
    assert isinstance(model, FusedLlamaLayers)
    assert compute_class(model) == "blend.adapters.fused_layers.FusedLlamaLayers"
    vllm_model = current_model()
    assert model._embed.data_ptr() == vllm_model.model.embed_tokens.weight.data_ptr()  # noqa: SLF001
    norm = vllm_model.model.layers[2].post_attention_layernorm.weight
    assert model.weights[2].post_norm.data_ptr() == norm.data_ptr()
    assert not model.compiled  # eager on CPU (compile_layers applies on CUDA)


def test_fused_layers_match_vllm_modules_layer_by_layer(adapters, tokenizer):
    """FusedLlamaLayers over vLLM's parameters (on CPU its projections are vLLM's packed linear
    modules, called) against VLLMModelAdapter's vLLM modules, seam by seam, same inputs."""
    from blend.adapters.vllm import fused_vllm_layers

    modules, _ = adapters
    fused = fused_vllm_layers(modules.model, model_id="smollm2")
    assert fused.spec == modules.spec and fused.scale == modules.scale
    assert "linear modules" in fused.weights_from  # vLLM's CPU backend packed the weights away
    ids = torch.tensor(tokenizer.encode(passage(11)))
    pos = torch.arange(len(ids)) + 300
    hidden = modules.embed(ids)
    torch.testing.assert_close(fused.embed(ids), hidden, rtol=0, atol=0)
    residual = None
    for layer in range(modules.spec.num_layers):
        got = fused.qkv(layer, hidden, residual, pos)
        q, k, v, residual = modules.qkv(layer, hidden, residual, pos)
        for a, b in zip(got, (q, k, v, residual), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        out = blocked_row_attention(q, k, v, None, modules.scale)
        got_h, got_r = fused.finish_layer(layer, out, residual)
        hidden, residual = modules.finish_layer(layer, out, residual)
        torch.testing.assert_close(got_h + got_r, hidden + residual, rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(fused.logits(hidden, residual), modules.logits(hidden, residual),
                               rtol=1e-4, atol=2e-4)
    k = torch.randn(5, 3, 64)
    frm, to = torch.arange(5), torch.tensor([9, 40, 7, 100, 3])
    torch.testing.assert_close(fused.rotate_k(k, frm, to), modules.rotate_k(k, frm, to), rtol=1e-5, atol=1e-5)


def test_a_model_the_fused_layers_cannot_compute_blends_through_vllm_modules(adapters, monkeypatch):
    from blend.adapters.vllm import VLLMModelAdapter, fused_vllm_layers, vllm_adapter

    model = adapters[0].model
    monkeypatch.setattr(model.logits_processor, "scale", 2.0)
    with pytest.raises(ValueError, match="scales or caps"):
        fused_vllm_layers(model)
    assert type(vllm_adapter(model)) is VLLMModelAdapter
    monkeypatch.undo()
    from types import SimpleNamespace

    from blend.adapters.vllm import _vllm_rope_table

    rope = model.model.layers[0].self_attn.rotary_emb
    cos, _ = _vllm_rope_table(rope, adapters[0].spec)  # vLLM's table, the spec's frequencies
    assert cos.shape == (rope.cos_sin_cache.shape[0], adapters[0].spec.head_dim)
    other = SimpleNamespace(cos_sin_cache=rope.cos_sin_cache.flip(1), is_neox_style=True, rotary_dim=64)
    with pytest.raises(ValueError, match="RoPE table"):
        _vllm_rope_table(other, adapters[0].spec)


def test_recompute_set_and_injected_kv_match_hf(adapters, local_client, blend_llm, blend_stats_path,
                                                tokenizer, smollm2_path):
    """Issue 6 test 2: same recompute set as the HF adapter (ties within 1e-4 relative of the
    k-th score may differ) and, with the HF set injected, the same KV."""
    from blend.engine import BlendEngine
    from cluster.namespace import namespace_for

    vllm_a, hf_a = adapters
    texts = [passage(600 + i, num_sentences=8) for i in range(3)]
    system = "Answer from the passages."
    ids1, _ = build_blend_prompt(tokenizer, system, texts, "Question: first?")
    cold = generate(blend_llm, ids1)
    wait_stored(blend_stats_path, cold.request_id)
    ids2, spans = build_blend_prompt(tokenizer, system, texts[::-1], "Question: second?")
    cfg = BlendConfig(recompute_ratios=(0.15,), min_tokens=0, selection="k_deviation")
    plan = make_plan(ids2, spans, namespace_for(smollm2_path, "float32").digest(), local_client, cfg)
    assert len(plan.hit_segments) == 3 and plan.blend
    r_v = BlendEngine(vllm_a, local_client).blend(plan, want_logits=False)
    r_h = BlendEngine(hf_a, local_client).blend(plan, want_logits=False)
    assert r_v.counters.num_hit_segments == r_h.counters.num_hit_segments == 3
    set_v, set_h = set(r_v.recompute_idx.tolist()), set(r_h.recompute_idx.tolist())
    if set_v != set_h:  # allowed only for near-ties at the cut
        check = plan.check_layers[0]
        hits = plan.hit_segments
        rows = torch.cat([torch.arange(s.start, s.end) for s in hits])
        fresh = BlendEngine(hf_a).prefill(list(ids2[:plan.blend_end]), want_logits=False).kv[check][0][rows]
        stored = torch.cat(local_client.fetch_layer([s.key for s in hits], check).result(), dim=1)
        cached = hf_a.rotate_k(stored[0], torch.cat([torch.tensor(s.stored_positions) for s in hits]), rows)
        scores = squared_deviation(fresh, cached)
        kth = scores.sort(descending=True).values[num_to_select(len(rows), 0.15) - 1]
        near = {int(r) for r, s in zip(rows, scores, strict=True) if abs(float(s - kth)) <= 1e-4 * float(kth)}
        assert (set_v ^ set_h) <= near, f"recompute sets differ beyond ties: {sorted(set_v ^ set_h)}"
    forced = dataclasses.replace(plan, forced_recompute=tuple(sorted(set_h)))
    r_v2 = BlendEngine(vllm_a, local_client).blend(forced, want_logits=False)
    r_h2 = BlendEngine(hf_a, local_client).blend(forced, want_logits=False)
    for layer, (a, b) in enumerate(zip(r_v2.kv, r_h2.kv, strict=True)):
        assert bool(torch.isfinite(a).all()), f"layer {layer}: non-finite KV"
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=lambda m, layer=layer: f"layer {layer}: {m}")


def test_cpu_paged_layout_matches_vllm_kernel(blend_llm):
    """cluster.vllm.paged's 'cpu' layout reads exactly what vLLM's CPU cache-update op wrote."""
    from cluster.vllm import paged

    runner = blend_llm.llm_engine.model_executor.driver_worker.worker.model_runner
    name = "model.layers.3.self_attn.attn"
    layer = runner.compilation_config.static_forward_context[name]
    cache = layer.kv_cache.clone()
    slots = torch.tensor([0, 1, 5, 130, 131, 300, 17])
    kv = torch.randn(2, len(slots), 3, 64)
    layer.impl.do_kv_cache_update(layer, kv[0].contiguous(), kv[1].contiguous(), cache, slots)
    torch.testing.assert_close(paged.gather_kv(cache, "cpu", slots), kv, rtol=0, atol=0)
    ours = layer.kv_cache.clone()
    paged.scatter_kv(ours, "cpu", kv, slots)
    assert torch.equal(paged.gather_kv(ours, "cpu", slots), paged.gather_kv(cache, "cpu", slots))
