"""The blend model of a vLLM worker: :func:`vllm_adapter`, and the module-by-module fallback.

:func:`vllm_adapter` is what ``cluster/vllm/worker.py`` builds. For unquantized and quantized
Llama-family layers (``LlamaForCausalLM``, ``MistralForCausalLM``: bias-free projections, SiLU-gated
MLP, RMSNorm, full-width neox RoPE) it returns
:class:`blend.adapters.fused_layers.FusedLlamaLayers` over vLLM's own parameters, no weight copy:
the same code ``kvblend bench gpu`` times. Its projections are vLLM's weight tensors (one GEMM
each: vLLM already fuses q|k|v and gate|up) where vLLM left a plain weight, and the vLLM linear
module itself (called, so vLLM's kernels run) where the linear is quantized or vLLM's CPU
backend packed its weight away (``dispatch_cpu_unquantized_gemm``). Any other model gets
:class:`VLLMModelAdapter`, described below; the reason is logged.

:class:`VLLMModelAdapter`, over vLLM's own modules:

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

import logging

import torch

from blend.adapters.fused_layers import FusedLlamaLayers, LlamaLayerWeights, Projection
from blend.adapters.hf import spec_from_config
from blend.rope import check_rope_linear, inv_freq_for, rerotate_k

log = logging.getLogger(__name__)

#: ``config.model_type`` values whose vLLM decoder layer is Llama's.
FUSED_VLLM_MODEL_TYPES = ("llama", "mistral")


def vllm_adapter(model: torch.nn.Module, model_id: str = "vllm", *,
                 compile: bool = False) -> FusedLlamaLayers | VLLMModelAdapter:
    """The :class:`~blend.protocols.BlendModel` a vLLM worker blends with (see module doc).

    Args:
        model: the ``*ForCausalLM`` vLLM built in this process.
        model_id: name used in the spec.
        compile: ``torch.compile`` the fused layers (only where every projection is a plain
            weight); the caller warms them up (:meth:`FusedLlamaLayers.warm_up`).

    Raises:
        ValueError: what :class:`VLLMModelAdapter` refuses (tensor parallelism, RoPE).
    """
    try:
        fused = fused_vllm_layers(model, model_id, compile=compile)
    except ValueError as e:
        log.info("blending through vLLM's modules (VLLMModelAdapter), not the fused layers: %s", e)
        return VLLMModelAdapter(model, model_id)
    log.info("blending with FusedLlamaLayers over %s", fused.weights_from)
    return fused


def _projection(linear: torch.nn.Module, name: str) -> tuple[Projection, bool]:
    """A vLLM linear as a :data:`Projection`: its weight when vLLM left a plain one (True), else
    the module itself, called (False). Raises ValueError for a linear with a bias."""
    if getattr(linear, "bias", None) is not None:
        raise ValueError(f"{name} has a bias")
    method = type(getattr(linear, "quant_method", None)).__name__
    weight = getattr(linear, "weight", None)
    if method == "UnquantizedLinearMethod" and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
            and weight.numel() > 0 and not hasattr(linear, "cpu_linear"):
        return weight.detach(), True
    return (lambda x, m=linear: m(x)[0]), False


def fused_vllm_layers(model: torch.nn.Module, model_id: str = "vllm", *,
                      compile: bool = False) -> FusedLlamaLayers:
    """:class:`FusedLlamaLayers` over a vLLM Llama-family model's parameters (no copy).

    The RoPE table is vLLM's own ``rotary_emb.cos_sin_cache``; the frequencies the engine
    re-rotates cached K with (:func:`blend.rope.inv_freq_for` of the spec) are checked against
    it. Raises ValueError where the fused layer would not compute vLLM's layer: another model
    type, tensor parallelism, biases, another norm or activation, a logit scale or soft cap,
    RoPE that is partial, not neox, or not the spec's.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_VLLM_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not a Llama-family layer")
    dtype = next(p for p in model.parameters()).dtype
    spec = spec_from_config(config, model_id, dtype)
    check_rope_linear(spec)
    core = model.model
    layers, plain = [], True
    for i, layer in enumerate(core.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.num_heads != spec.num_heads or attn.num_kv_heads != spec.num_kv_heads:
            raise ValueError(f"tensor parallelism: this rank holds {attn.num_heads} of {spec.num_heads} heads")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm).__name__ != "RMSNorm" or getattr(norm, "variance_size_override", None):
                raise ValueError(f"layer {i}: {type(norm).__name__} is not a plain RMSNorm")
        if type(mlp.act_fn).__name__ != "SiluAndMul":
            raise ValueError(f"layer {i}: activation {type(mlp.act_fn).__name__} is not SiLU-and-mul")
        projections = {}
        for name, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                             ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
            projections[name], is_plain = _projection(linear, f"layer {i} {name}")
            plain = plain and is_plain
        layers.append(LlamaLayerWeights(input_norm=layer.input_layernorm.weight.detach(),
                                        post_norm=layer.post_attention_layernorm.weight.detach(),
                                        **projections))
    processor = getattr(model, "logits_processor", None)
    if processor is not None and (float(getattr(processor, "scale", 1.0)) != 1.0
                                  or getattr(processor, "soft_cap", None) is not None):
        raise ValueError("the logits processor scales or caps the logits")
    lm_head = getattr(model.lm_head, "weight", None)
    if type(getattr(model.lm_head, "quant_method", None)).__name__ != "UnquantizedEmbeddingMethod" \
            or not isinstance(lm_head, torch.Tensor) or lm_head.dim() != 2 or lm_head.numel() == 0:
        raise ValueError("the LM head is quantized or has no plain weight")
    cos, sin = _vllm_rope_table(core.layers[0].self_attn.rotary_emb, spec)
    eps = float(core.layers[0].input_layernorm.variance_epsilon)
    return FusedLlamaLayers(
        spec, layers, embed=core.embed_tokens.weight.detach(), final_norm=core.norm.weight.detach(),
        lm_head=lm_head.detach(), eps=eps, scale=float(core.layers[0].self_attn.scaling),
        inv_freq=inv_freq_for(spec), rope_cos_sin=(cos, sin), compile=compile,
        weights_from="vLLM's " + ("weights" if plain else "weights and linear modules (quantized or packed)"))


def _vllm_rope_table(rope: torch.nn.Module, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[P, D]`` float32 from vLLM's ``cos_sin_cache`` ``[P, D]`` (cos half, sin
    half), after checking it is full-width neox RoPE with the spec's frequencies."""
    head_dim = spec.head_dim
    if not getattr(rope, "is_neox_style", True) or getattr(rope, "rotary_dim", head_dim) != head_dim:
        raise ValueError("RoPE is not full-width neox style")
    cache = rope.cos_sin_cache.detach().float()
    half = head_dim // 2
    cos, sin = cache[:, :half], cache[:, half:]
    pos = torch.tensor([1, 17, 511, cache.shape[0] - 1], dtype=torch.float32, device=cache.device)
    angles = torch.outer(pos, inv_freq_for(spec).to(cache.device))
    scaling = float(cos[0, 0])  # cos(0) times the attention scaling vLLM baked in
    want = torch.cat((angles.cos(), angles.sin()), dim=-1) * scaling
    got = torch.cat((cos[pos.long()], sin[pos.long()]), dim=-1)
    if not torch.allclose(got, want, atol=2e-3, rtol=0):
        raise ValueError("vLLM's RoPE table does not match the spec's frequencies")
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


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
