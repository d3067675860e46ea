"""The fused Llama decoder layer: the one compute path of a vLLM worker and ``kvblend bench gpu``.

The blend engine (:mod:`blend.engine`) drives a model through CacheBlend's seams
(:class:`blend.protocols.BlendModel`: embed, qkv, the engine's own attention, finish_layer,
logits). For Llama-family layers (Llama 2/3, Mistral, SmolLM) :class:`FusedLlamaLayers`
computes them with few kernel launches per layer::

    qkv()           RMSNorm -> one GEMM by W_q|k|v -> RoPE from a cos/sin table
    finish_layer()  o_proj -> + residual -> RMSNorm -> one GEMM by W_gate|up -> SiLU * up -> down

over weights it does not own. Two builders hand it weights; both run this class's code:

* :func:`blend.adapters.vllm.vllm_adapter` (what ``cluster/vllm/worker.py`` builds): a vLLM
  worker's own parameters. vLLM already stores q|k|v and gate|up as one matrix each. A
  projection that is quantized, or whose weight vLLM's CPU backend packed away, is called
  through its vLLM module (:class:`LlamaLayerWeights` takes a callable there).
* :class:`blend.adapters.fused_llama.FusedLlamaAdapter`: a transformers ``LlamaForCausalLM``
  (the GPU benchmark's model and the CPU tests'), its q/k/v and gate/up matrices concatenated.

Why fused: eager HF modules cost ~45 kernel launches and ~1 ms of Python per layer, longer than
the GPU work of a 15% recompute of a 4K-8K prompt (H200, 2026-11-29). With ``compile=True`` the
per-layer functions are ``torch.compile``-d (``dynamic=True``) when every projection is a plain
weight; a compile failure falls back to eager for good, with one warning.

Math: RMSNorm in float32 then scaled by the weight in the model dtype (as HF and vLLM do), RoPE
in neox (rotate-half) form from a table ``[max_position, D]`` built once in float32 from the
model's ``inv_freq`` and attention scaling and rounded to the model dtype. Against HF's or
vLLM's modules only the order of sums differs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from blend import ops
from blend.protocols import ModelSpec
from blend.rope import check_rope_linear

log = logging.getLogger(__name__)

#: A projection: a weight ``[N, K]`` (one GEMM, ``x @ w.t()``) or a callable ``[T, K] -> [T, N]``
#: (a quantized or backend-packed linear, run through its owner's module).
Projection = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class LlamaLayerWeights:
    """One decoder layer's weights, borrowed from the model that owns them (never copied).

    Shapes (E hidden, F intermediate, Hq/H query/KV heads, D head dim): ``input_norm`` and
    ``post_norm`` ``[E]``; ``qkv`` ``[(Hq + 2H) * D, E]`` (rows q, then k, then v); ``o``
    ``[E, Hq * D]``; ``gate_up`` ``[2F, E]`` (gate rows, then up); ``down`` ``[E, F]``.
    """

    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection

    @property
    def plain(self) -> bool:
        """Every projection is a weight tensor (so the layer can be compiled)."""
        return all(isinstance(p, torch.Tensor) for p in (self.qkv, self.o, self.gate_up, self.down))


def project(x: torch.Tensor, w: Projection) -> torch.Tensor:
    """``x`` ``[T, K]`` through ``w`` (see :data:`Projection`): ``[T, N]``."""
    return x @ w.t() if isinstance(w, torch.Tensor) else w(x)


def rope_table(inv_freq: torch.Tensor, max_position: int, attention_scaling: float,
               dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_position, D]`` in ``dtype`` (neox layout: both halves equal), built
    in float32 from ``inv_freq`` ``[D/2]`` and scaled by ``attention_scaling``."""
    pos = torch.arange(max_position, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.to(device, torch.float32))
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


class FusedLlamaLayers:
    """:class:`~blend.protocols.BlendModel` of a Llama-family decoder over borrowed weights.

    Args:
        spec: the model's shape (:class:`blend.protocols.ModelSpec`).
        layers: one :class:`LlamaLayerWeights` per decoder layer.
        embed: token embedding ``[V', E]`` (``V' >= spec.vocab_size``: vLLM pads the vocab).
        final_norm: ``[E]``; lm_head: ``[V', E]`` (may be ``embed`` itself, tied weights).
        eps: RMSNorm epsilon. scale: the attention's softmax scale the engine uses.
        inv_freq: ``[D/2]`` float32, the RoPE frequencies cached K is re-rotated with.
        attention_scaling: factor on the cos/sin table (1.0 but for YaRN-like RoPE).
        rope_cos_sin: a ready table (cos, sin) ``[P, D]`` to use instead (the owner's own).
        compile: ``torch.compile`` the per-layer functions (only when every layer is plain).
        weights_from: where the weights came from, for logs and benchmark JSON.

    Inputs may sit on any device; outputs are on :attr:`device` in :attr:`dtype` (logits
    ``[T, spec.vocab_size]`` float32). Methods run under ``torch.no_grad``.

    Raises:
        ValueError: RoPE that is not linear in position, or no ``max_position``.
    """

    def __init__(self, spec: ModelSpec, layers: list[LlamaLayerWeights], *, embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float, scale: float,
                 inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, compile: bool = False,
                 weights_from: str = "") -> None:
        check_rope_linear(spec)
        if spec.max_position <= 0:
            raise ValueError("the model has no max_position_embeddings (the RoPE table's size)")
        if len(layers) != spec.num_layers:
            raise ValueError(f"{len(layers)} layers of weights for a {spec.num_layers}-layer model")
        self.spec, self.weights, self.scale, self.eps = spec, list(layers), float(scale), float(eps)
        self.weights_from = weights_from
        self._embed, self._norm, self._lm_head = embed, final_norm, lm_head
        self._device, self._dtype = embed.device, embed.dtype
        self._inv_freq = inv_freq.to(self._device, torch.float32)
        if rope_cos_sin is not None:
            self._cos, self._sin = (t.to(self._device, self._dtype) for t in rope_cos_sin)
        else:
            with torch.no_grad():
                self._cos, self._sin = rope_table(self._inv_freq, spec.max_position, attention_scaling,
                                                  self._dtype, self._device)
        self._qkv_eager, self._finish_eager = _layer_functions(spec, self.eps)
        self._qkv, self._finish = self._qkv_eager, self._finish_eager
        self.compiled = False
        if compile and all(w.plain for w in self.weights):
            try:
                self._qkv = torch.compile(self._qkv_eager, dynamic=True)
                self._finish = torch.compile(self._finish_eager, dynamic=True)
                self.compiled = True
            except Exception as e:  # noqa: BLE001 - no compiler here: stay eager, say so
                self._fall_back(e)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def inv_freq(self) -> torch.Tensor:
        """``[D/2]`` float32 on :attr:`device` (what the engine re-rotates cached K with)."""
        return self._inv_freq

    def warm_up(self) -> float:
        """Run every per-layer function once on dummy rows (1 and 17 tokens) so that compiling
        happens now, not in a request; returns the seconds it took. Who calls it: the vLLM
        worker when it builds its blend engine at start-up, the GPU benchmark before timing."""
        start = time.perf_counter()
        for rows in (1, 17):
            hidden = self.embed(torch.zeros(rows, dtype=torch.long))
            q, _, _, residual = self.qkv(0, hidden, None, torch.arange(rows))
            self.finish_layer(0, q.reshape(rows, -1), residual)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter() - start

    def _fall_back(self, e: Exception) -> None:
        log.warning("torch.compile of the fused Llama layers failed (%s: %s); running eager",
                    type(e).__name__, e)
        self._qkv, self._finish, self.compiled = self._qkv_eager, self._finish_eager, False

    def _call(self, name: str, *args):
        try:
            return getattr(self, name)(*args)
        except Exception as e:  # noqa: BLE001 - compile failure: stay correct, say so
            if not self.compiled or (self._device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                raise  # eager's own error, or a CUDA graph's capture failed (blend.probe_graphs)
            self._fall_back(e)
            return getattr(self, name)(*args)

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._embed[token_ids.to(self._device)]                               # [T, E]

    @torch.no_grad()
    def qkv(self, layer_idx: int, hidden: torch.Tensor, residual: torch.Tensor | None,
            positions: torch.Tensor):
        residual = hidden if residual is None else hidden + residual
        w = self.weights[layer_idx]
        pos = positions.to(self._device)
        q, k, v = self._call("_qkv", residual, w.input_norm, w.qkv, self._cos[pos], self._sin[pos])
        return q, k, v, residual                          # [T, Hq, D], [T, H, D] x2, [T, E]

    def rotate_k(self, k: torch.Tensor, from_positions: torch.Tensor,
                 to_positions: torch.Tensor) -> torch.Tensor:
        return ops.rerotate_k_(k.clone(), from_positions, to_positions, self._inv_freq.to(k.device))

    @torch.no_grad()
    def finish_layer(self, layer_idx: int, attn_out: torch.Tensor, residual: torch.Tensor):
        w = self.weights[layer_idx]
        return self._call("_finish", attn_out.to(self._dtype), residual, w.o, w.post_norm,
                          w.gate_up, w.down)                                          # [T, E] x2

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x = hidden + residual
        normed = self._norm * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (normed @ self._lm_head[: self.spec.vocab_size].t()).float()        # [T, V]


def _layer_functions(spec: ModelSpec, eps: float):
    """The per-layer ``qkv`` and ``finish`` functions (closures over the head counts and eps,
    so ``torch.compile`` sees constants)."""
    num_heads, num_kv, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def rms(x, w):
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def qkv(residual, norm_w, wqkv, cos, sin):
        t = residual.shape[0]
        out = project(rms(residual, norm_w), wqkv)
        q, k, v = out.split([num_heads * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
        q = rope(q.reshape(t, num_heads, head_dim), cos[:, None], sin[:, None])
        k = rope(k.reshape(t, num_kv, head_dim), cos[:, None], sin[:, None])
        return q, k, v.reshape(t, num_kv, head_dim)

    def finish(attn_out, residual, wo, norm_w, wgu, wdown):
        residual = residual + project(attn_out, wo)
        gate, up = project(rms(residual, norm_w), wgu).chunk(2, dim=-1)
        return project(F.silu(gate) * up, wdown), residual

    return qkv, finish
