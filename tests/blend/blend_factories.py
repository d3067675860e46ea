"""Factories for blend tests: tiny random-weight HF models (float32), a cache with chunks in it.

Tolerances (float32): full prefill through the engine and HF's own forward differ only by the
order of floating-point sums inside the attention kernels, ~1e-6 relative; we allow
``rtol=1e-4, atol=1e-4`` for KV and logits of tiny models (values O(1), 4 layers).
"""

from __future__ import annotations

import torch

from blend.adapters.hf import HFModelAdapter
from blend.config import BlendConfig
from blend.engine import BlendEngine
from blend.planner import make_plan
from cluster.cache.local import LocalCacheClient
from tiers.keys import segment_key

NAMESPACE = "0123456789abcdef"
F32_TOL = dict(rtol=1e-4, atol=1e-4)


def tiny_model(model_type: str = "llama", *, num_layers: int = 4, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, vocab: int = 128, max_position: int = 1024,
               rope_parameters: dict | None = None, seed: int = 0, **extra):
    """A random-weight causal LM of ``model_type`` (float32, eval mode)."""
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    cfg_cls, model_cls = (getattr(transformers, n) for n in classes[model_type])
    params = {"rope_type": "default", "rope_theta": 10000.0, **(rope_parameters or {})}
    config = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=num_layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, max_position_embeddings=max_position,
                     rope_parameters=params, tie_word_embeddings=False, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Larger-than-default weights so that attention is far from uniform and K deviations
    # between cached and blended KV are substantial (random init at std 0.02 is nearly inert).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
    return model


def tiny_adapter(model_type: str = "llama", **kw) -> HFModelAdapter:
    return HFModelAdapter(tiny_model(model_type, **kw), model_id=f"tiny-{model_type}")


def store_chunks(engine: BlendEngine, client: LocalCacheClient, chunks) -> None:
    """Compute and store each chunk's canonical KV (the chunk alone at 0..n-1)."""
    for ids in chunks:
        kv = torch.stack(engine.prefill(ids, want_logits=False).kv)  # [L, 2, T, H, D]
        client.put(segment_key(NAMESPACE, ids), kv)


def blend_prompt(prefix, chunks, query, sep=(7, 8)):
    """Token ids and spans of ``prefix sep c1 sep c2 ... sep query`` (ids, not text)."""
    ids, spans = [], []

    def add(kind, piece):
        if piece:
            spans.append((kind, len(ids), len(ids) + len(piece)))
            ids.extend(piece)

    add("prefix", list(prefix))
    for c in chunks:
        add("sep", list(sep))
        add("chunk", list(c))
    add("sep", list(sep))
    add("query", list(query))
    return ids, spans


def random_chunks(num: int, length: int, vocab: int = 128, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(num)]


def plan_for(ids, spans, client, *, ratio=0.15, check_layers=(1,), min_tokens=0,
             query_to_engine=True, thresholds=()):
    config = BlendConfig(check_layers=tuple(check_layers), recompute_ratios=(ratio,),
                         recompute_thresholds=tuple(thresholds), min_tokens=min_tokens)
    return make_plan(ids, spans, NAMESPACE, client, config, query_to_engine=query_to_engine)
