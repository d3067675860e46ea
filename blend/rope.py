"""RoPE re-rotation of cached K, and the gate that refuses models it would garble.

CacheBlend (Yao et al., EuroSys 2025, §4.3 and §5) reuses a chunk's KV at a position other
than the one it was computed at. With rotary embeddings the stored K is ``R(p_s * w) k``
(``w`` = inverse frequencies, ``R`` a 2-D rotation per frequency pair), so moving it to a new
position ``p_n`` is one more rotation by ``(p_n - p_s) * w``::

    R(p_n w) k = R((p_n - p_s) w) R(p_s w) k

This holds only when the angle is *linear in position* with frequencies that do not depend on
the sequence length: plain RoPE, ``linear`` position interpolation, llama3-style frequency
scaling and YaRN. YaRN also multiplies cos/sin by an attention factor; the stored K already
carries it, and a pure rotation keeps it, so it is never applied twice. Dynamic NTK and
longrope change the frequencies with the sequence length, and a sliding window shorter than
the prompt changes which keys a query sees: both are refused with ``ValueError``.

The rotation pairs dimension ``i`` with ``i + D/2`` (the "neox" layout used by HF Llama,
Mistral, Qwen2 and vLLM's ``is_neox_style=True``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from blend.protocols import ModelSpec

#: RoPE types whose angle is ``position * inv_freq`` with fixed ``inv_freq``.
LINEAR_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: RoPE types that recompute frequencies from the sequence length.
NONLINEAR_ROPE_TYPES = ("dynamic", "longrope")


def rope_type(rope_scaling: Mapping[str, object] | None) -> str:
    """The RoPE type named by a HF ``rope_scaling``/``rope_parameters`` dict (``default`` if none)."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def check_blendable(spec: ModelSpec, num_tokens: int) -> None:
    """Refuse blending for models whose cached K cannot be moved by a rotation.

    Args:
        spec: the model's shapes and RoPE parameters.
        num_tokens: length of the blended prompt.

    Raises:
        ValueError: RoPE type not linear in position (dynamic NTK, longrope, unknown), or
            a sliding window shorter than ``num_tokens``.
    """
    check_rope_linear(spec)
    if spec.sliding_window is not None and spec.sliding_window < num_tokens:
        raise ValueError(
            f"model {spec.model_id!r} has sliding_window={spec.sliding_window} shorter than the "
            f"prompt ({num_tokens} tokens): blending is refused (tokens outside the window would "
            f"be attended)")


def check_rope_linear(spec: ModelSpec) -> None:
    """Raise ValueError unless ``spec``'s RoPE angle is linear in position (see module doc)."""
    scaling = dict(spec.rope_scaling)
    kind = rope_type(scaling)
    if kind not in LINEAR_ROPE_TYPES:
        why = ("its frequencies change with the sequence length" if kind in NONLINEAR_ROPE_TYPES
               else "it is not a known position-linear RoPE")
        raise ValueError(
            f"model {spec.model_id!r} uses rope_type={kind!r}: cached K cannot be re-rotated because "
            f"{why}; blending is refused (supported: {', '.join(LINEAR_ROPE_TYPES)})")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"model {spec.model_id!r}: partial_rotary_factor="
                         f"{scaling['partial_rotary_factor']} is not supported for blending")


def inv_freq_for(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` float32 of a position-linear RoPE.

    Follows the published definitions: Su et al. (RoPE), Chen et al. 2023 (``linear``),
    Meta's Llama 3.1 frequency scaling (``llama3``), Peng et al. 2023 (YaRN, §3.3 ramp).

    Raises:
        ValueError: a RoPE type that :func:`check_blendable` refuses.
    """
    scaling = dict(spec.rope_scaling)
    kind = rope_type(scaling)
    check_rope_linear(spec)
    dim = spec.head_dim
    base = float(spec.rope_theta)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv = 1.0 / (base ** exponents)  # [D/2] float64
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor,
                          torch.where(wavelen < old_ctx / high, inv, mid))
    elif kind == "yarn":
        factor = float(scaling["factor"])
        old_ctx = float(scaling.get("original_max_position_embeddings") or spec.max_position / factor)
        beta_fast = float(scaling.get("beta_fast") or 32)
        beta_slow = float(scaling.get("beta_slow") or 1)
        truncate = bool(scaling.get("truncate", True))

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(old_ctx / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        # Interpolated frequencies where the ramp is 1, original ones where it is 0.
        inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    return inv.to(torch.float32)


def rerotate_k(k: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor,
               inv_freq: torch.Tensor) -> torch.Tensor:
    """Move post-RoPE K from ``from_positions`` to ``to_positions`` (one rotation, a copy).

    Args:
        k: post-RoPE keys, any float dtype.
        from_positions: positions ``k`` was rotated at.
        to_positions: target positions.
        inv_freq: inverse frequencies of a position-linear RoPE.

    Shapes:
        k: ``[T, H, D]``; from_positions, to_positions: ``[T]`` int64; inv_freq: ``[D/2]``
        float32. Returns ``[T, H, D]`` in ``k.dtype``.

    The angle ``(to - from) * inv_freq`` is formed from the integer difference in float64 and
    the rotation is applied in float32 (for bf16 K, one rounding at the end).

    Raises:
        ValueError: shapes that do not match.
    """
    if k.dim() != 3 or k.shape[-1] != 2 * inv_freq.shape[-1]:
        raise ValueError(f"k must be [T, H, D] with D = 2 * {inv_freq.shape[-1]}, got {tuple(k.shape)}")
    if from_positions.shape != (k.shape[0],) or to_positions.shape != (k.shape[0],):
        raise ValueError(f"positions must be [{k.shape[0]}], got {tuple(from_positions.shape)} "
                         f"and {tuple(to_positions.shape)}")
    delta = (to_positions.to(torch.int64) - from_positions.to(torch.int64)).to(k.device)
    angle = (delta.to(torch.float64)[:, None] * inv_freq.to(k.device, torch.float64)[None, :])
    angle = torch.cat((angle, angle), dim=-1).to(torch.float32)  # [T, D]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]  # [T, 1, D]
    kf = k.to(torch.float32)
    half = kf.shape[-1] // 2
    rotated_half = torch.cat((-kf[..., half:], kf[..., :half]), dim=-1)
    return (kf * cos + rotated_half * sin).to(k.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               attention_factor: float = 1.0) -> torch.Tensor:
    """Reference RoPE (neox layout) of ``x`` ``[T, H, D]`` at ``positions`` ``[T]``; tests use it."""
    zero = torch.zeros_like(positions)
    out = rerotate_k(x, zero, positions, inv_freq)
    return out if attention_factor == 1.0 else (out.to(torch.float32) * attention_factor).to(x.dtype)
