"""The vLLM adapter of :class:`blend.protocols.BlendModel`, over vLLM's own modules.

Wraps a vLLM decoder-only model already loaded by a vLLM worker (``LlamaForCausalLM`` and
models with the same seams: Qwen2, Mistral-style Llama) and calls its modules directly —
no second copy of the weights, vLLM's kernels for every op:

    embed          model.model.embed_tokens            (VocabParallelEmbedding)
    qkv            layer.input_layernorm (fused residual add)
                   -> layer.self_attn.qkv_proj (fused QKV) -> layer.self_attn.rotary_emb
    finish_layer   layer.self_attn.o_proj -> layer.post_attention_layernorm (fused add)
                   -> layer.mlp
    logits         model.model.norm (fused add) -> model.compute_logits (lm_head)

Attention itself is the blend engine's (CacheBlend needs its K deviation and selective
recompute, which vLLM's paged attention does not expose). The connector writes the blended
KV into vLLM's paged cache; vLLM's attention then reads it for the query and decode.

vLLM's fused ops work in place (``fused_add_rms_norm`` overwrites both its inputs, the CPU
``rotary_embedding`` op overwrites q and k); the adapter passes them copies, so the engine's
tensors are never modified behind its back.

Tensor-parallel size 1 only (the parallel linears would need their collectives); a model
with a non-neox or partial rotary embedding is refused with ``ValueError``.
"""

from __future__ import annotations

import torch

from blend.adapters.hf import spec_from_config
from blend.rope import check_rope_linear, inv_freq_for, rerotate_k


class VLLMModelAdapter:
    """:class:`~blend.protocols.BlendModel` over a loaded vLLM model (one sequence at a time).

    Args:
        model: a vLLM ``*ForCausalLM`` module (``model.model.layers[i].self_attn.qkv_proj``...).
        model_id: name used in the spec.

    Raises:
        ValueError: tensor parallelism > 1, a non-neox or partial rotary embedding, or RoPE
            that is not linear in position (:func:`blend.rope.check_rope_linear`).
    """

    def __init__(self, model: torch.nn.Module, model_id: str = "vllm") -> None:
        self.model = model
        self.layers = list(model.model.layers)
        first = next(p for p in model.parameters())
        self._dtype = first.dtype
        self._device = first.device
        self.spec = spec_from_config(model.config, model_id, self._dtype)  # the HF adapter's spec
        attn = self.layers[0].self_attn
        if attn.num_heads != self.spec.num_heads or attn.num_kv_heads != self.spec.num_kv_heads:
            raise ValueError(f"tensor parallelism is not supported by the vLLM adapter "
                             f"(this rank holds {attn.num_heads} of {self.spec.num_heads} heads)")
        rope = attn.rotary_emb
        if not getattr(rope, "is_neox_style", True) or getattr(rope, "rotary_dim", attn.head_dim) != attn.head_dim:
            raise ValueError("the vLLM adapter supports full-width neox-style rotary embeddings only")
        check_rope_linear(self.spec)
        self._inv_freq = inv_freq_for(self.spec).to(self._device)
        self._q_size, self._kv_size = attn.q_size, attn.kv_size
        self.scale = float(attn.scaling)  # softmax scale the engine uses

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 -> ``[T, E]``."""
        return self.model.model.embed_tokens(token_ids.to(self._device))

    @torch.inference_mode()
    def qkv(self, layer_idx: int, hidden: torch.Tensor, residual: torch.Tensor | None,
            positions: torch.Tensor):
        """Input norm (fused residual add), fused QKV projection, vLLM's RoPE.

        Shapes: hidden, residual ``[T, E]``; positions ``[T]``. Returns q ``[T, Hq, D]``,
        k, v ``[T, H, D]`` and the new residual ``[T, E]``.
        """
        layer = self.layers[layer_idx]
        attn = layer.self_attn
        if residual is None:
            residual = hidden.clone()
            normed = layer.input_layernorm(hidden.clone())
        else:
            normed, residual = layer.input_layernorm(hidden.clone(), residual.clone())
        qkv, _ = attn.qkv_proj(normed)
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        q, k = attn.rotary_emb(positions.to(self._device), q.contiguous(), k.contiguous())
        num_tokens, head_dim = hidden.shape[0], attn.head_dim
        return (q.reshape(num_tokens, -1, head_dim), k.reshape(num_tokens, -1, head_dim),
                v.reshape(num_tokens, -1, head_dim), residual)

    def rotate_k(self, k: torch.Tensor, from_positions: torch.Tensor,
                 to_positions: torch.Tensor) -> torch.Tensor:
        """Re-rotate post-RoPE K ``[T, H, D]`` (see :func:`blend.rope.rerotate_k`)."""
        return rerotate_k(k, from_positions, to_positions, self._inv_freq)

    @torch.inference_mode()
    def finish_layer(self, layer_idx: int, attn_out: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, post-attention norm (fused residual add), MLP. ``attn_out`` ``[T, Hq*D]``."""
        layer = self.layers[layer_idx]
        out, _ = layer.self_attn.o_proj(attn_out.to(self._dtype).contiguous())
        hidden, residual = layer.post_attention_layernorm(out, residual.clone())
        return layer.mlp(hidden), residual

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[T, V]`` float32."""
        normed, _ = self.model.model.norm(hidden.clone(), residual.clone())
        return self.model.compute_logits(normed)[:, : self.spec.vocab_size].float()
