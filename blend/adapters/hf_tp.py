"""A tensor-parallel shard of a Hugging Face Llama-family model, as a BlendModel (one rank).

Sharded like Megatron-LM (Shoeybi et al. 2019, §3) and vLLM's ``ColumnParallelLinear`` /
``RowParallelLinear``: rank ``r`` of ``P`` keeps its slice of the heads and of the MLP::

    q_proj, k_proj, v_proj   column-parallel: query heads [r*Hq/P, (r+1)*Hq/P), KV heads [r*H/P, ...)
    o_proj                   row-parallel: the input columns of those query heads, then all_reduce
    gate_proj, up_proj       column-parallel: intermediate features [r*I/P, (r+1)*I/P)
    down_proj                row-parallel: the same features' input columns, then all_reduce
    embed_tokens, norms, lm_head   replicated

So each rank's KV is ``[T, H/P, D]``: the KV heads of its own slice, stored under its own
chunk namespace (``tiers.keys.Namespace(tp_rank, tp_size)``, ``num_kv_heads = H/P``). The
blend engine needs one more reduction, of the check layer's scores (``BlendEngine(...,
process_group=...)``). Output biases (``o_proj``/``down_proj``, when the config has them) are
added once, by rank 0, after the sum. For tests and the TP benchmark; vLLM shards its own.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from blend.adapters.hf import HFModelAdapter


def _rows(linear: torch.nn.Linear, start: int, end: int) -> torch.nn.Linear:
    """Column-parallel slice: output features ``[start, end)``."""
    out = torch.nn.Linear(linear.in_features, end - start, bias=linear.bias is not None,
                          device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[start:end])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[start:end])
    return out


def _columns(linear: torch.nn.Linear, start: int, end: int, keep_bias: bool) -> torch.nn.Linear:
    """Row-parallel slice: input features ``[start, end)`` (bias kept on one rank only)."""
    has_bias = linear.bias is not None and keep_bias
    out = torch.nn.Linear(end - start, linear.out_features, bias=has_bias,
                          device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[:, start:end])
        if has_bias:
            out.bias.copy_(linear.bias)
    return out


class HFTensorParallelAdapter(HFModelAdapter):
    """Rank ``tp_rank`` of a ``tp_size``-way tensor-parallel HF Llama/Mistral/Qwen2 model.

    Args:
        model: the whole causal LM (same weights on every rank); its decoder layers'
            projections are replaced in place by this rank's shards.
        tp_rank: this rank, ``0 <= tp_rank < tp_size``.
        tp_size: ranks in ``group``.
        group: the ``torch.distributed`` group the row-parallel outputs are summed over
            (None: the default group).
        model_id: name used in the spec.

    ``spec.num_heads``/``spec.num_kv_heads`` are this rank's (``Hq/P``, ``H/P``), as the chunk
    namespace wants them. Shapes: :class:`blend.protocols.BlendModel` with ``Hq/P`` and ``H/P``.

    Raises:
        ValueError: a rank outside ``0..tp_size-1``, or query heads, KV heads or MLP features
            not divisible by ``tp_size``; plus the errors of :class:`HFModelAdapter`.
    """

    def __init__(self, model, tp_rank: int, tp_size: int, group=None, model_id: str = "") -> None:
        super().__init__(model, model_id=model_id)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in 0..{tp_size - 1}")
        config = model.config
        spec = self.spec
        intermediate = int(config.intermediate_size)
        for name, n in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
                        ("intermediate_size", intermediate)):
            if n % tp_size:
                raise ValueError(f"{name}={n} is not divisible by tp_size={tp_size}")
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        d = spec.head_dim
        hq, h, inter = spec.num_heads // tp_size, spec.num_kv_heads // tp_size, intermediate // tp_size
        q0, k0, i0 = tp_rank * hq * d, tp_rank * h * d, tp_rank * inter
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj = _rows(attn.q_proj, q0, q0 + hq * d)
            attn.k_proj = _rows(attn.k_proj, k0, k0 + h * d)
            attn.v_proj = _rows(attn.v_proj, k0, k0 + h * d)
            attn.o_proj = _columns(attn.o_proj, q0, q0 + hq * d, keep_bias=tp_rank == 0)
            mlp.gate_proj = _rows(mlp.gate_proj, i0, i0 + inter)
            mlp.up_proj = _rows(mlp.up_proj, i0, i0 + inter)
            mlp.down_proj = _columns(mlp.down_proj, i0, i0 + inter, keep_bias=tp_rank == 0)
        self.spec = dataclasses.replace(spec, num_heads=hq, num_kv_heads=h)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    @torch.no_grad()
    def finish_layer(self, layer_idx: int, attn_out: torch.Tensor, residual: torch.Tensor):
        """Row-parallel ``o_proj`` and MLP, each summed over the group (``attn_out`` holds
        this rank's ``Hq/P`` heads: ``[T, Hq/P * D]``)."""
        layer = self.layers[layer_idx]
        residual = residual + self._all_reduce(layer.self_attn.o_proj(attn_out))
        hidden = self._all_reduce(layer.mlp(layer.post_attention_layernorm(residual)))
        return hidden, residual
