"""Which reused tokens to recompute: KV deviation at a check layer, top ratio, optional threshold.

CacheBlend (Yao et al., EuroSys 2025, §4.2-§4.3) observes that the tokens whose cached KV
deviates most from the KV they would get with full cross-attention ("high-KV-deviation"
tokens) are few, and that tokens with high deviation at one layer tend to keep it in the next.
So at a check layer every reused token is computed once more, its fresh K is compared with
the re-rotated cached K (the paper's measure; the engine can rank by V or K+V instead, see
:class:`blend.engine.BlendEngine`), and only the top ``recompute_ratio`` share is recomputed in
the layers above. A threshold (when set) drops selected tokens whose deviation is already small.

* :func:`squared_deviation` — the per-token score, on K or on V (the reference of
  :func:`blend.kernels.deviation.deviation_scores`);
* :func:`num_to_select` — how many of the reused tokens a ratio keeps;
* :func:`top_n_indices` — which: the ``n`` highest scores, minus those under the threshold
  (:func:`blend.ops.select_top_ratio` applies a ratio to a request's reused rows with it).
"""

from __future__ import annotations

import math

import torch


def squared_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token squared L2 distance between fresh and cached K (or V), summed over KV heads.

    Args:
        fresh: the freshly computed K (post-RoPE) or V of each token.
        cached: the cached K (re-rotated to the same positions) or V of the same tokens.

    Shapes:
        fresh, cached: ``[R, H, D]`` (any float dtype). Returns ``[R]`` float32.

    Raises:
        ValueError: shapes differ.
    """
    if fresh.shape != cached.shape or fresh.dim() != 3:
        raise ValueError(f"fresh and cached K/V must both be [R, H, D]: {tuple(fresh.shape)} vs "
                         f"{tuple(cached.shape)}")
    diff = fresh.to(torch.float32) - cached.to(torch.float32)
    return diff.square().sum(dim=(1, 2))


def num_to_select(num_reused: int, ratio: float) -> int:
    """``ceil(ratio * num_reused)`` (guarded against float noise such as 0.15 * 100)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute ratio {ratio} must be in [0, 1]")
    return min(num_reused, max(0, math.ceil(ratio * num_reused - 1e-9)))


def top_n_indices(scores: torch.Tensor, num_select: int, threshold: float | None = None) -> torch.Tensor:
    """Indices of the ``num_select`` highest scores, minus those scoring below ``threshold``.

    Args:
        scores: deviation (K or V) per candidate token.
        num_select: how many to keep at most (clamped to the number of candidates).
        threshold: optional floor; a selected token with ``score < threshold`` is dropped.

    Shapes:
        scores: ``[R]`` float. Returns ``[S]`` int64 indices into ``scores``, ascending,
        ``S <= min(num_select, R)``.
    """
    num_select = min(max(num_select, 0), scores.shape[0])
    if num_select == 0:
        return torch.zeros(0, dtype=torch.int64, device=scores.device)
    top = torch.topk(scores, num_select, sorted=False).indices
    if threshold is not None:
        top = top[scores[top] >= threshold]
    return top.sort().values
