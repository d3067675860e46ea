"""Tiny models, chunks and plans for the ops/staging tests (CPU or CUDA).

Tolerances: float32 end-to-end through the engine differs from full prefill only by the
order of sums in attention/matmul kernels (~1e-6 relative on these O(1) values): 1e-4.
"""

from __future__ import annotations

import torch

from blend import ops
from blend.adapters.hf import HFModelAdapter
from blend.plan import CHUNK, PREFIX, QUERY, SEPARATOR, BlendPlan, Segment
from tiers.format import encode_chunk
from tiers.keys import segment_key

NAMESPACE = "0123456789abcdef"
F32_TOL = dict(rtol=1e-4, atol=1e-4)


class OpsAdapter(HFModelAdapter):
    """The HF adapter with :func:`blend.ops.rerotate_k_` as its re-rotation (as integrated)."""

    def rotate_k(self, k, from_positions, to_positions):
        return ops.rerotate_k_(k.clone(), from_positions, to_positions, self._inv_freq.to(k.device))


def tiny_adapter(device="cpu", *, num_layers=4, hidden=64, heads=4, kv_heads=2, vocab=128,
                 dtype=torch.float32, seed=0) -> OpsAdapter:
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=num_layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=4096,
                                      tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # far from uniform attention, so K deviations are substantial
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
    return OpsAdapter(model.to(device=device, dtype=dtype), model_id="tiny-llama")


def chunk_ids(num_chunks: int, num_tokens: int, vocab: int = 128, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (num_tokens,), generator=g).tolist() for _ in range(num_chunks)]


def make_plan(chunks: list[list[int]], ratio: float, *, prefix=(1, 2, 3), query=(5, 6, 7, 8),
              sep: int = 3, check_layer: int = 1) -> BlendPlan:
    """``| prefix | sep | chunk 1 | ... | sep | query |`` with every chunk a canonical hit."""
    ids = list(prefix)
    segments = [Segment(PREFIX, 0, len(ids))]
    for chunk in chunks:
        segments.append(Segment(SEPARATOR, len(ids), len(ids) + 1))
        ids.append(sep)
        segments.append(Segment(CHUNK, len(ids), len(ids) + len(chunk), key=segment_key(NAMESPACE, chunk),
                                hit=True, stored_positions=tuple(range(len(chunk)))))
        ids.extend(chunk)
    segments.append(Segment(SEPARATOR, len(ids), len(ids) + 1))
    ids.append(sep)
    segments.append(Segment(QUERY, len(ids), len(ids) + len(query)))
    ids.extend(query)
    return BlendPlan(tuple(ids), tuple(segments), check_layers=(check_layer,), recompute_ratios=(ratio,),
                     blend_end=len(ids))


def encode(key, kv: torch.Tensor, compress: bool = False) -> bytes:
    """Chunk object of ``kv`` ``[L, 2, T, H, D]`` (lz4 layers where they shrink with ``compress``)."""
    host = kv.detach().cpu().contiguous()
    raw = host.view(torch.uint8).view(host.shape[0], -1).numpy()
    return encode_chunk(key, [raw[i] for i in range(host.shape[0])], dtype=str(host.dtype).removeprefix("torch."),
                        num_tokens=host.shape[2], num_kv_heads=host.shape[3], head_dim=host.shape[4],
                        compress=compress)


def fill_tiers(engine, chunks, tiers_with_objects=(), gpu_tiers=()):
    """Compute each chunk's canonical KV; put objects into byte tiers, tensors into gpu tiers."""
    out = {}
    for ids in chunks:
        key = segment_key(NAMESPACE, ids)
        kv = torch.stack(engine.prefill(ids, want_logits=False).kv)  # [L, 2, T, H, D]
        out[key] = kv
        obj = encode(key, kv)
        for tier in tiers_with_objects:
            assert tier.put(key, obj)
        for tier in gpu_tiers:
            assert tier.put(key, kv)
    return out
