"""The bench's fused :class:`blend.protocols.BlendModel` over a ``LlamaForCausalLM`` (``kvblend bench gpu``)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class FastLlama:
    """A :class:`blend.protocols.BlendModel` over a ``LlamaForCausalLM``'s weights, built for
    few kernel launches: fused ``q|k|v`` and ``gate|up`` weight matrices (one GEMM each),
    RoPE from a precomputed cos/sin table, and (``use_compile``) the per-layer ``qkv`` and
    ``finish_layer`` math compiled by ``torch.compile`` (dynamic row counts), so norms, RoPE
    and SiLU-mul fuse into the GEMMs' neighbours. Same math as HF's Llama layer (RMSNorm in
    float32, RoPE cos/sin rounded to the model dtype as HF does).

    Why: eager HF modules cost ~45 kernel launches and ~1 ms of Python per layer, which at
    15% of 4K-8K rows is longer than the GPU work (measured on the H200, 2026-11-29).
    """

    def __init__(self, hf_model, spec, scale: float, ops, use_compile: bool) -> None:
        import torch
        import torch.nn.functional as F

        self.torch, self.ops, self.spec, self.scale = torch, ops, spec, scale
        core = hf_model.model
        self._embed = core.embed_tokens.weight
        self._device, self._dtype = self._embed.device, self._embed.dtype
        self.eps = float(hf_model.config.rms_norm_eps)
        with torch.no_grad():
            self._layers = [tuple(w.detach() for w in (
                layer.input_layernorm.weight,
                torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                           layer.self_attn.v_proj.weight]).contiguous(),        # [(Hq+2H)*D, E]
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).contiguous(),  # [2F, E]
                layer.mlp.down_proj.weight)) for layer in core.layers]
            self._norm, self._lm_head = core.norm.weight.detach(), hf_model.lm_head.weight.detach()
            self._inv_freq = core.rotary_emb.inv_freq.detach().to(self._device, torch.float32)
            self.inv_freq = self._inv_freq  # what the engine re-rotates cached K with
            scaling = float(getattr(core.rotary_emb, "attention_scaling", 1.0))
            max_pos = max(spec.max_position, 1)
            freqs = torch.outer(torch.arange(max_pos, device=self._device, dtype=torch.float32), self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)                                  # [P, D]
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
        if use_compile:
            self._qkv = torch.compile(qkv, dynamic=True)
            self._finish = torch.compile(finish, dynamic=True)
            self.compiled = True

    @property
    def device(self):
        return self._device

    @property
    def dtype(self):
        return self._dtype

    def _call(self, name: str, *args):
        try:
            return getattr(self, name)(*args)
        except Exception as e:  # noqa: BLE001 - compile failure: stay correct, say so
            if not self.compiled:
                raise
            log.warning("torch.compile of the bench model failed (%s: %s); running eager", type(e).__name__, e)
            self._qkv, self._finish, self.compiled = self._qkv_eager, self._finish_eager, False
            return getattr(self, name)(*args)

    def embed(self, token_ids):
        return self._embed[token_ids.to(self._device)]                               # [T, E]

    def qkv(self, layer_idx, hidden, residual, positions):
        with self.torch.no_grad():
            residual = hidden if residual is None else hidden + residual
            w = self._layers[layer_idx]
            pos = positions.to(self._device)
            q, k, v = self._call("_qkv", residual, w[0], w[1], self._cos[pos], self._sin[pos])
            return q, k, v, residual

    def rotate_k(self, k, from_positions, to_positions):
        return self.ops.rerotate_k_(k.clone(), from_positions, to_positions, self._inv_freq)

    def finish_layer(self, layer_idx, attn_out, residual):
        with self.torch.no_grad():
            w = self._layers[layer_idx]
            return self._call("_finish", attn_out, residual, w[2], w[3], w[4], w[5])

    def logits(self, hidden, residual):
        with self.torch.no_grad():
            x = hidden + residual
            normed = self._norm * self.torch.nn.functional.rms_norm(
                x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
            return (normed @ self._lm_head.t()).float()                              # [T, V]
