"""Dispatching entry points of the blend hot path: Triton/FlexAttention on CUDA, torch elsewhere.

The engine calls these with the tensors it already holds (``[T, H, D]`` K/V of the prompt,
``[A, Hq, D]`` queries of the computed rows, int64 positions); each picks the fast path for
CUDA tensors and the plain-torch reference otherwise, with the same results up to the
dtype's rounding (``tests/blend/test_ops.py`` and ``test_ops_cuda.py`` compare them).

* :func:`rerotate_k_` — cached K moved to new positions, in place (Triton).
* :func:`deviation_scores` + :func:`select_top_ratio` — the check layer's selection (Triton + topk).
* :func:`causal_attention` — the engine's attention: plain causal prefill, or selected query
  rows over the whole mixed KV with per-row causal limits, through
  :func:`selected_row_attention` (:mod:`blend.flex_rows`: FlexAttention, compiled, with a
  block mask built from the selected positions) on CUDA and
  :func:`blend.attention.blocked_row_attention` (SDPA over blocks of position-sorted rows)
  elsewhere. Neither materializes a ``[T, T]`` mask.
* :func:`prepare_flex` — FlexAttention compiled ahead for every key bucket (at start-up).
* :func:`gather_paged` / :func:`scatter_paged` — vLLM paged KV by ``slot_mapping`` (Triton).

Axis letters as in :mod:`blend.protocols`; ``Q`` = selected query rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blend import attention as _attention
from blend.flex_rows import (
    FLEX_BLOCK,
    PAD_TILE_POSITION,
    PROBE_ROWS,
    RowMask,
    build_block_mask,
    pad_rows,
    prepare_flex,
    prepare_rows,
    selected_row_attention,
    selected_row_attention_reference,
    shape_bucket,
)
from blend.kernels.deviation import deviation_scores
from blend.kernels.paged import gather_paged, scatter_paged
from blend.kernels.rope import rerotate_k_
from blend.selection import num_to_select, top_n_indices

__all__ = ["FLEX_BLOCK", "PAD_TILE_POSITION", "PROBE_ROWS", "RowMask", "build_block_mask", "causal_attention", "deviation_of",
           "deviation_scores", "gather_paged", "pad_rows", "prepare_flex", "prepare_rows", "rerotate_k_",
           "scatter_paged", "select_top_ratio", "selected_row_attention", "selected_row_attention_reference",
           "shape_bucket"]


def deviation_of(score: str, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, fresh_idx: torch.Tensor,
                 cached_idx: torch.Tensor) -> torch.Tensor:
    """Deviation ``[Rc]`` float32 of fresh rows ``k[fresh_idx]`` (``v``) ``[A, H, D]`` from the
    cached rows ``kv[:, cached_idx]`` of a layer buffer ``[2, T, H, D]`` (``score``: ``k``,
    ``v`` or ``kv``, their sum), summed over KV heads (:func:`deviation_scores`; the engine
    sums it over tensor-parallel ranks)."""
    def one(fresh, cached):  # the engine's own rows: in range by construction (no host wait)
        return deviation_scores(fresh, cached, fresh_idx, cached_idx, check_range=False)

    if score == "k":
        return one(k, kv[0])
    if score == "v":
        return one(v, kv[1])
    return one(k, kv[0]) + one(v, kv[1])


def select_top_ratio(scores: torch.Tensor, ratio: float, threshold: float | None = None,
                     candidates: torch.Tensor | None = None, *, num_reused: int | None = None) -> torch.Tensor:
    """The top ``ratio`` of candidates by KV deviation (CacheBlend §4.3), minus those under ``threshold``.

    Args:
        scores: deviation per candidate (:func:`deviation_scores` of K or V).
        ratio: recompute ratio in ``[0, 1]``; ``ceil(ratio * num_reused)`` are kept.
        threshold: optional floor on the score of a kept candidate.
        candidates: what to return for each score (e.g. prompt rows); None: score indices.
        num_reused: the count the ratio applies to (default: ``len(scores)``); the engine
            passes all reused rows of the request.

    Shapes:
        scores: ``[R]``; candidates: ``[R]`` int64. Returns ``[S]`` int64, in the order of
        ascending score index (ascending rows when ``candidates`` ascends), on scores' device.

    Raises:
        ValueError: ratio outside ``[0, 1]`` or candidates of another length.
    """
    if candidates is not None and candidates.shape != scores.shape:
        raise ValueError(f"candidates {tuple(candidates.shape)} must match scores {tuple(scores.shape)}")
    num_select = num_to_select(scores.numel() if num_reused is None else num_reused, ratio)
    idx = top_n_indices(scores, num_select, threshold)
    return idx if candidates is None else candidates.to(scores.device)[idx]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_idx: torch.Tensor | None,
                     scale: float, rows: RowMask | None = None) -> torch.Tensor:
    """The engine's attention: query rows at positions ``query_idx`` over keys ``0..T-1``, causal.

    Drop-in for :func:`blend.attention.blocked_row_attention` (same arguments, shapes and errors).

    ``query_idx=None`` is plain causal prefill (SDPA ``is_causal``: flash/cuDNN on CUDA);
    otherwise :func:`selected_row_attention` with keys at ``0..T-1`` (and ``rows``, when the
    caller prepared them once per request) on CUDA, and
    :func:`blend.attention.blocked_row_attention` on other devices: its blocks of 128 position-sorted rows read keys only up to their last row
    (a SmolLM2 blend of 3K tokens at ratio 0.15 on 2 CPU cores: 2.19 s through the engine with
    :func:`selected_row_attention_reference`, 1.57 s with this; 2026-11-29).
    """
    if query_idx is None:
        if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0]:
            raise ValueError(f"query_idx=None needs one query per key: q {tuple(q.shape)}, k {tuple(k.shape)}")
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                             v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)
    if not (q.is_cuda and k.is_cuda):
        return _attention.blocked_row_attention(q, k, v, query_idx, scale)
    return selected_row_attention(q, query_idx, k, v, None, scale, rows=rows)
