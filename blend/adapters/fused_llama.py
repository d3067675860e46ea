"""Llama (and Mistral) as a :class:`blend.protocols.BlendModel` built for few kernel launches.

:class:`FusedLlamaAdapter` computes the same decoder layer as :class:`blend.adapters.hf.HFModelAdapter`
from the same ``LlamaForCausalLM`` weights, cut at the same seams, but with its own torch code
instead of HF's modules::

    [ RMSNorm -> one GEMM by W_q|k|v -> RoPE from a cos/sin table ]              = qkv()
    (attention: done by blend.engine over the mixed KV)
    [ o_proj -> + residual -> RMSNorm -> one GEMM by W_gate|up -> SiLU * up -> down ] = finish_layer()

Why: eager HF modules cost ~45 kernel launches and ~1 ms of Python per layer, which at a
recompute ratio of 15% of 4K-8K-token prompts is longer than the GPU work (measured on the
H200, 2026-11-29). ``kvblend bench gpu`` times this adapter by default.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from blend import ops
from blend.adapters.hf import HFModelAdapter
from blend.rope import check_rope_linear

log = logging.getLogger(__name__)

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


class FusedLlamaAdapter(HFModelAdapter):
    """A transformers ``LlamaForCausalLM`` (or ``MistralForCausalLM``) cut for the blend engine,
    with few kernel launches per layer.

    What it fuses: the ``q|k|v`` and the ``gate|up`` weight matrices are concatenated (one
    GEMM each per layer); RoPE reads a cos/sin table ``[max_position, D]`` built once (in
    float32 from the model's ``inv_freq`` and ``attention_scaling``, rounded to the model
    dtype, as HF's rotary embedding does); RMSNorm is ``F.rms_norm`` in float32. Same math as
    HF's layer; results differ from :class:`HFModelAdapter`'s only by the order of sums.
    The HF model's q/k/v and gate/up weights become views of the fused matrices (no extra
    weight memory; the model's own forward is unchanged). Build the adapter after the model
    is on its device and in its dtype.

    Args:
        hf_model: a loaded ``LlamaForCausalLM``/``MistralForCausalLM`` with plain bias-free
            ``nn.Linear`` projections, on any device, float32/bfloat16/float16.
        model_id: name used in the spec (default: the config's ``name_or_path``).
        compile: ``torch.compile`` (``dynamic=True``) the per-layer ``qkv`` and
            ``finish_layer`` math so norms, RoPE and SiLU-mul fuse into the GEMMs'
            neighbours. If compiling or running the compiled code fails, the adapter logs
            one warning, falls back to eager for good (:attr:`compiled` becomes False) and
            returns the eager result.

    The spec, the attention ``scale`` and ``inv_freq`` (``[D/2]`` float32 on the model's
    device; what :meth:`rotate_k` and the engine re-rotate cached K with) come from
    :class:`HFModelAdapter`. Shapes and dtypes: see :class:`blend.protocols.BlendModel`
    (inputs on any device; outputs on :attr:`device` in :attr:`dtype`, logits float32).
    All methods run under ``torch.no_grad``. No CUDA-only call outside ``compile``.

    Raises:
        ValueError: another model type or layer layout, RoPE that is not linear in position
            (the cos/sin table is fixed), or no ``max_position_embeddings``.
    """

    def __init__(self, hf_model, *, model_id: str = "", compile: bool = False) -> None:
        super().__init__(hf_model, model_id=model_id)  # spec, scale, inv_freq; eval()
        model_type = getattr(hf_model.config, "model_type", None)
        if model_type not in FUSED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} has no fused adapter "
                             f"(supported: {', '.join(FUSED_MODEL_TYPES)}); use HFModelAdapter")
        check_rope_linear(self.spec)
        if self.spec.max_position <= 0:
            raise ValueError("the config has no max_position_embeddings (the RoPE table's size)")
        spec = self.spec
        self._device, self._dtype = self.device, self.dtype  # HFModelAdapter's: the embedding's
        self.eps = float(hf_model.config.rms_norm_eps)
        with torch.no_grad():
            self._embed = self.core.embed_tokens.weight.detach()                      # [V, E]
            self._layers = [(
                layer.input_layernorm.weight.detach(),
                _fuse_rows(layer.self_attn, ("q_proj", "k_proj", "v_proj")),         # [(Hq+2H)*D, E]
                layer.self_attn.o_proj.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                _fuse_rows(layer.mlp, ("gate_proj", "up_proj")),                      # [2F, E]
                layer.mlp.down_proj.weight.detach()) for layer in self.layers]
            self._norm = self.core.norm.weight.detach()
            self._lm_head = hf_model.lm_head.weight.detach()
            self._inv_freq = self._inv_freq.to(self._device, torch.float32)           # [D/2]
            scaling = float(getattr(self.core.rotary_emb, "attention_scaling", 1.0))
            pos = torch.arange(spec.max_position, device=self._device, dtype=torch.float32)
            freqs = torch.outer(pos, self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)                                   # [P, D]
            self._cos = (emb.cos() * scaling).to(self._dtype)
            self._sin = (emb.sin() * scaling).to(self._dtype)
        num_heads, num_kv, head_dim, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, self.eps

        def rms(x, w):
            return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

        def rope(x, cos, sin):
            half = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        def qkv(residual, norm_w, wqkv, cos, sin):
            t = residual.shape[0]
            out = rms(residual, norm_w) @ wqkv.t()
            q, k, v = out.split([num_heads * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
            q = rope(q.view(t, num_heads, head_dim), cos[:, None], sin[:, None])
            k = rope(k.view(t, num_kv, head_dim), cos[:, None], sin[:, None])
            return q, k, v.reshape(t, num_kv, head_dim)

        def finish(attn_out, residual, wo, norm_w, wgu, wdown):
            residual = residual + attn_out @ wo.t()
            gate, up = (rms(residual, norm_w) @ wgu.t()).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ wdown.t(), residual

        self._qkv_eager, self._finish_eager = qkv, finish
        self._qkv, self._finish = qkv, finish
        self.compiled = False
        if compile:
            try:
                self._qkv = torch.compile(qkv, dynamic=True)
                self._finish = torch.compile(finish, dynamic=True)
                self.compiled = True
            except Exception as e:  # noqa: BLE001 - no compiler here: stay eager, say so
                self._fall_back(e)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, model_id: str = "", *,
                        compile: bool = False) -> FusedLlamaAdapter:
        """Load a HF folder as :meth:`HFModelAdapter.from_pretrained` does, then fuse."""
        plain = HFModelAdapter.from_pretrained(path, dtype=dtype, model_id=model_id)
        return cls(plain.model, model_id=plain.spec.model_id, compile=compile)

    def _fall_back(self, e: Exception) -> None:
        log.warning("torch.compile of the fused Llama layers failed (%s: %s); running eager",
                    type(e).__name__, e)
        self._qkv, self._finish, self.compiled = self._qkv_eager, self._finish_eager, False

    def _call(self, name: str, *args):
        try:
            return getattr(self, name)(*args)
        except Exception as e:  # noqa: BLE001 - compile failure: stay correct, say so
            if not self.compiled:
                raise
            self._fall_back(e)
            return getattr(self, name)(*args)

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._embed[token_ids.to(self._device)]                               # [T, E]

    @torch.no_grad()
    def qkv(self, layer_idx: int, hidden: torch.Tensor, residual: torch.Tensor | None,
            positions: torch.Tensor):
        residual = hidden if residual is None else hidden + residual
        w = self._layers[layer_idx]
        pos = positions.to(self._device)
        q, k, v = self._call("_qkv", residual, w[0], w[1], self._cos[pos], self._sin[pos])
        return q, k, v, residual                          # [T, Hq, D], [T, H, D] x2, [T, E]

    def rotate_k(self, k: torch.Tensor, from_positions: torch.Tensor,
                 to_positions: torch.Tensor) -> torch.Tensor:
        return ops.rerotate_k_(k.clone(), from_positions, to_positions, self._inv_freq)

    @torch.no_grad()
    def finish_layer(self, layer_idx: int, attn_out: torch.Tensor, residual: torch.Tensor):
        w = self._layers[layer_idx]
        return self._call("_finish", attn_out, residual, w[2], w[3], w[4], w[5])   # [T, E] x2

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x = hidden + residual
        normed = self._norm * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (normed @ self._lm_head.t()).float()                                  # [T, V]
