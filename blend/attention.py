"""Causal attention of some query rows over a whole (mixed) KV, with per-query causal limits.

After the check layer CacheBlend recomputes only selected tokens (Yao et al., §4.2): their
queries sit at scattered prompt positions and each must see exactly the keys at positions
``<= its own`` — fresh K/V for recomputed rows, re-rotated cached K/V for the rest::

    keys:      0 1 2 3 4 5 6 7 8 9          mask row for the query at position 4:
    query 4 -> x x x x x . . . . .          True for 0..4, False for 5..9

:func:`blocked_row_attention` takes the selected rows in position order, in blocks of
:data:`QUERY_BLOCK`, builds a ``[Qb, Tb]`` boolean mask per block (``Tb`` = the block's last
position + 1, so keys no row of the block may see are never read) and calls torch's SDPA
(grouped-query heads via ``enable_gqa``); :func:`dense_attention_reference` is the slow dense
reference (full ``[T, T]`` causal mask, explicit float64 softmax) that tests compare against.
It is the engine's attention off CUDA (:func:`blend.ops.causal_attention` dispatches to it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Query rows per SDPA call on the masked path (bounds the ``[Qb, T]`` mask).
QUERY_BLOCK = 128


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str = "q") -> None:
    """Raise ValueError unless ``q`` is ``[Q, Hq, D]`` and ``k``, ``v`` are ``[T, H, D]`` with
    ``Hq`` a multiple of ``H`` (grouped-query heads)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"{name} must be [Q, Hq, D], k and v [T, H, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]} "
                         f"with the same head dim")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_idx: torch.Tensor | None) -> None:
    check_heads(q, k, v)
    if query_idx is None:
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"query_idx=None needs one query per key: {q.shape[0]} != {k.shape[0]}")
    elif query_idx.shape != (q.shape[0],):
        raise ValueError(f"query_idx must be [{q.shape[0]}], got {tuple(query_idx.shape)}")


def blocked_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_idx: torch.Tensor | None,
                          scale: float, rows: object = None) -> torch.Tensor:
    """Causal attention of query rows at prompt positions ``query_idx`` over all keys.

    Args:
        q: queries (after RoPE) of the computed rows.
        k, v: keys (after RoPE) and values of every prompt token ``0..T-1``.
        query_idx: prompt position of each query row (any order); None means all rows
            ``0..T-1`` in order (plain causal prefill).
        scale: softmax scale (``head_dim ** -0.5`` for these models).
        rows: ignored; accepted so that this reference is a drop-in for
            :func:`blend.ops.causal_attention`, which takes the mask prepared by
            :func:`blend.flex_rows.prepare_rows`.

    Shapes:
        q: ``[Q, Hq, D]``; k, v: ``[T, H, D]``; query_idx: ``[Q]`` int64 in ``[0, T)``.
        Returns ``[Q, Hq * D]`` in ``q.dtype``.

    Raises:
        ValueError: inconsistent shapes.
    """
    _check(q, k, v, query_idx)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    if query_idx is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Blocks of query rows in position order; each block reads keys only up to its last
        # row (future keys are masked anyway): about half the work of one [Q, T] product.
        query_idx = query_idx.to(k.device)
        order = torch.argsort(query_idx)
        sorted_idx = query_idx[order]
        out = torch.empty(1, qh.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
        for b in range(0, q.shape[0], QUERY_BLOCK):
            rows = order[b:b + QUERY_BLOCK]
            pos = sorted_idx[b:b + QUERY_BLOCK]
            num_keys = int(pos[-1]) + 1
            key_pos = torch.arange(num_keys, device=k.device)
            mask = key_pos[None, :] <= pos[:, None]  # [Qb, Tb] bool
            out[:, :, rows] = F.scaled_dot_product_attention(
                qh[:, :, rows], kh[:, :, :num_keys], vh[:, :, :num_keys], attn_mask=mask, scale=scale,
                enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)  # [Q, Hq * D]


def dense_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_idx: torch.Tensor | None,
                              scale: float) -> torch.Tensor:
    """Dense reference of :func:`blocked_row_attention`: scores for all ``[T, T]`` pairs under a
    full causal mask in float64, then the rows of ``query_idx`` are picked. Same shapes and errors."""
    _check(q, k, v, query_idx)
    num_tokens = k.shape[0]
    if query_idx is None:
        query_idx = torch.arange(num_tokens, device=q.device)
    group = q.shape[1] // k.shape[1]
    kd = k.to(torch.float64).repeat_interleave(group, dim=1)  # [T, Hq, D]
    vd = v.to(torch.float64).repeat_interleave(group, dim=1)
    full_q = torch.zeros(num_tokens, q.shape[1], q.shape[2], dtype=torch.float64, device=q.device)
    full_q[query_idx] = q.to(torch.float64)
    scores = torch.einsum("qhd,khd->hqk", full_q, kd) * scale  # [Hq, T, T]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vd)  # [T, Hq, D]
    return out[query_idx].reshape(len(query_idx), -1).to(q.dtype)
