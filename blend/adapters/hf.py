"""Hugging Face transformers models (Llama, Mistral, Qwen2; SmolLM2 is Llama) as a BlendModel.

The adapter reuses the HF modules of each decoder layer and cuts them at CacheBlend's seams::

    embed_tokens -> [ input_layernorm -> q/k/v_proj -> rotary_emb ] = qkv()
                    (attention: done by blend.engine over the mixed KV)
                    [ o_proj -> + residual -> post_attention_layernorm -> mlp ] = finish_layer()
                 -> norm -> lm_head = logits()

The residual stream travels beside the hidden state, vLLM style: ``qkv`` adds the previous
layer's MLP output to the residual before its input norm, as HF's ``residual + hidden``.
RoPE comes from the model's own ``rotary_emb`` (so full prefill is exactly HF's, whatever
the RoPE type); re-rotation of cached K uses :func:`blend.rope.rerotate_k` with the model's
inverse frequencies and is refused for RoPE that is not linear in position.
"""

from __future__ import annotations

import torch

from blend.protocols import ModelSpec
from blend.rope import check_rope_linear, rerotate_k, rope_type

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _rope_scaling(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(getattr(config, "rope_scaling", None) or {})
    params.pop("rope_theta", None)
    return params


def spec_from_config(config, model_id: str = "", dtype: torch.dtype = torch.float32) -> ModelSpec:
    """:class:`ModelSpec` from a HF ``PretrainedConfig`` (Llama/Mistral/Qwen2 field names)."""
    num_heads = int(config.num_attention_heads)
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = _rope_scaling(config)
    if rope_type(scaling) == "default":
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_type", "type")}
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if getattr(config, "model_type", "") == "qwen2" and layer_types is not None \
            and "sliding_attention" not in layer_types:
        window = None
    return ModelSpec(
        model_id=model_id or str(getattr(config, "name_or_path", "") or config.model_type),
        num_layers=int(config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // num_heads),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        rope_theta=float(theta),
        rope_scaling=tuple(sorted((str(k), v if isinstance(v, (int, float, str, bool)) or v is None
                                   else str(v)) for k, v in scaling.items())),
        sliding_window=int(window) if window else None,
        max_position=int(getattr(config, "max_position_embeddings", 0) or 0),
        dtype=str(dtype).removeprefix("torch."),
    )


class HFModelAdapter:
    """A transformers ``*ForCausalLM`` (Llama, Mistral, Qwen2) cut for the blend engine.

    Args:
        model: a loaded causal LM whose ``model.model`` has ``embed_tokens``, ``layers``
            (each with ``self_attn.{q,k,v,o}_proj``, ``input_layernorm``,
            ``post_attention_layernorm``, ``mlp``), ``norm`` and ``rotary_emb``.
        model_id: name used in the spec (default: the config's ``name_or_path``).

    Shapes: see :class:`blend.protocols.BlendModel`. All methods run under ``torch.no_grad``.

    Raises:
        ValueError: a model type outside :data:`SUPPORTED_MODEL_TYPES` or of another layout.
    """

    def __init__(self, model, model_id: str = "") -> None:
        config = model.config
        if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={getattr(config, 'model_type', None)!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        self.model = model.eval()
        self.core = model.model
        self.layers = list(self.core.layers)
        self.spec = spec_from_config(config, model_id, next(model.parameters()).dtype)
        self.scale = float(getattr(self.layers[0].self_attn, "scaling", self.spec.head_dim ** -0.5))
        self._inv_freq = self.core.rotary_emb.inv_freq.detach().to(torch.float32).clone()

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, model_id: str = "") -> HFModelAdapter:
        """Load a HF folder (offline) with SDPA attention in ``dtype``."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        return cls(model, model_id=model_id or path.rstrip("/").rsplit("/", 1)[-1])

    @property
    def device(self) -> torch.device:
        return self.core.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.core.embed_tokens.weight.dtype

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.core.embed_tokens(token_ids.to(self.device))  # [T, E]

    @torch.no_grad()
    def qkv(self, layer_idx: int, hidden: torch.Tensor, residual: torch.Tensor | None,
            positions: torch.Tensor):
        layer = self.layers[layer_idx]
        attn = layer.self_attn
        residual = hidden if residual is None else hidden + residual
        x = layer.input_layernorm(residual)  # [T, E]
        num_tokens, head_dim = x.shape[0], self.spec.head_dim
        q = attn.q_proj(x).view(num_tokens, -1, head_dim)  # [T, Hq, D]
        k = attn.k_proj(x).view(num_tokens, -1, head_dim)  # [T, H, D]
        v = attn.v_proj(x).view(num_tokens, -1, head_dim)
        cos, sin = self.core.rotary_emb(x, positions.to(self.device)[None])  # [1, T, D]
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]                   # [T, 1, D]
        half = head_dim // 2
        q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
        return q, k, v, residual

    @property
    def inv_freq(self) -> torch.Tensor:
        """The model's own inverse RoPE frequencies ``[D/2]`` float32 (what :meth:`rotate_k`
        and the engine's in-place re-rotation use)."""
        return self._inv_freq

    def rotate_k(self, k: torch.Tensor, from_positions: torch.Tensor,
                 to_positions: torch.Tensor) -> torch.Tensor:
        check_rope_linear(self.spec)
        return rerotate_k(k, from_positions, to_positions, self._inv_freq)

    @torch.no_grad()
    def finish_layer(self, layer_idx: int, attn_out: torch.Tensor, residual: torch.Tensor):
        layer = self.layers[layer_idx]
        residual = residual + layer.self_attn.o_proj(attn_out)
        hidden = layer.mlp(layer.post_attention_layernorm(residual))
        return hidden, residual

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.core.norm(hidden + residual)).to(torch.float32)  # [T, V]
