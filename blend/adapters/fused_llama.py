"""A transformers Llama (or Mistral) as the fused compute a vLLM worker runs.

:class:`FusedLlamaAdapter` hands a ``LlamaForCausalLM``'s weights to
:class:`blend.adapters.fused_layers.FusedLlamaLayers`, the class whose code a vLLM worker blends
with (:func:`blend.adapters.vllm.vllm_adapter` builds it over vLLM's own parameters). It computes
the same decoder layer as :class:`blend.adapters.hf.HFModelAdapter`, cut at the same seams, with
fused GEMMs and a RoPE table instead of HF's modules. ``kvblend bench gpu`` and the CPU tests
build their fast model with it.
"""

from __future__ import annotations

import torch

from blend.adapters.fused_layers import FusedLlamaLayers, LlamaLayerWeights
from blend.adapters.hf import HFModelAdapter
from blend.rope import check_rope_linear

#: Model types whose decoder layer is Llama's (bias-free projections, SiLU-gated MLP).
FUSED_MODEL_TYPES = ("llama", "mistral")


def _fuse_rows(module, names: tuple[str, ...]) -> torch.Tensor:
    """One ``[sum N_i, E]`` matrix of the ``nn.Linear`` weights ``names`` of ``module``.

    Each Linear's weight is re-pointed at its row slice of the fused matrix (same values, same
    module), so the HF model and the adapter share one copy of the weights."""
    linears = [getattr(module, name) for name in names]
    for name, lin in zip(names, linears, strict=True):
        if type(lin) is not torch.nn.Linear or lin.bias is not None:
            raise ValueError(f"{name} is not a bias-free torch.nn.Linear; use HFModelAdapter")
    fused = torch.cat([lin.weight.detach() for lin in linears]).contiguous()
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[start:start + rows], requires_grad=lin.weight.requires_grad)
        start += rows
    return fused


class FusedLlamaAdapter(FusedLlamaLayers):
    """A transformers ``LlamaForCausalLM`` (or ``MistralForCausalLM``) as
    :class:`~blend.adapters.fused_layers.FusedLlamaLayers`: the compute a vLLM worker runs
    (:func:`blend.adapters.vllm.vllm_adapter`), over HF's weights.

    The ``q|k|v`` and the ``gate|up`` weight matrices are concatenated (one GEMM each per
    layer) and the HF model's q/k/v and gate/up weights become views of the fused matrices (no
    extra weight memory; the model's own forward is unchanged). The RoPE table follows HF's
    rotary embedding (its ``inv_freq`` and ``attention_scaling``). Build the adapter after the
    model is on its device and in its dtype.

    Args:
        hf_model: a loaded ``LlamaForCausalLM``/``MistralForCausalLM`` with plain bias-free
            ``nn.Linear`` projections, on any device, float32/bfloat16/float16.
        model_id: name used in the spec (default: the config's ``name_or_path``).
        compile: see :class:`~blend.adapters.fused_layers.FusedLlamaLayers`.

    Attributes ``model``, ``core`` (``model.model``) and ``layers`` (its decoder layers) are
    the HF objects, as on :class:`HFModelAdapter`.

    Raises:
        ValueError: another model type or layer layout, RoPE that is not linear in position
            (the cos/sin table is fixed), or no ``max_position_embeddings``.
    """

    def __init__(self, hf_model, *, model_id: str = "", compile: bool = False) -> None:
        plain = HFModelAdapter(hf_model, model_id=model_id)  # spec, scale, inv_freq; eval()
        model_type = getattr(hf_model.config, "model_type", None)
        if model_type not in FUSED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} has no fused adapter "
                             f"(supported: {', '.join(FUSED_MODEL_TYPES)}); use HFModelAdapter")
        check_rope_linear(plain.spec)
        self.model, self.core, self.layers = plain.model, plain.core, plain.layers
        with torch.no_grad():
            weights = [LlamaLayerWeights(
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=_fuse_rows(layer.self_attn, ("q_proj", "k_proj", "v_proj")),     # [(Hq+2H)*D, E]
                o=layer.self_attn.o_proj.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=_fuse_rows(layer.mlp, ("gate_proj", "up_proj")),              # [2F, E]
                down=layer.mlp.down_proj.weight.detach()) for layer in self.layers]
        super().__init__(
            plain.spec, weights, embed=self.core.embed_tokens.weight.detach(),
            final_norm=self.core.norm.weight.detach(), lm_head=hf_model.lm_head.weight.detach(),
            eps=float(hf_model.config.rms_norm_eps), scale=plain.scale, inv_freq=plain.inv_freq,
            attention_scaling=float(getattr(self.core.rotary_emb, "attention_scaling", 1.0)),
            compile=compile, weights_from=f"transformers {type(hf_model).__name__}")

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, model_id: str = "", *,
                        compile: bool = False) -> FusedLlamaAdapter:
        """Load a HF folder as :meth:`HFModelAdapter.from_pretrained` does, then fuse."""
        plain = HFModelAdapter.from_pretrained(path, dtype=dtype, model_id=model_id)
        return cls(plain.model, model_id=plain.spec.model_id, compile=compile)
