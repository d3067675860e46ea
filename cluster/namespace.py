"""The chunk namespace of a served model, computed the same way by every process.

The vLLM scheduler and workers, ``kvblend ingest`` and ``kvblend clear`` all call
:func:`namespace_for` with the model folder, so their keys agree without sharing state.
"""

from __future__ import annotations

import json
import os

from tiers.fingerprint import fingerprint_checkpoint
from tiers.keys import Namespace


def rope_key(hf_config: dict) -> str:
    """Canonical string of the RoPE parameters in a HF ``config.json`` dict."""
    theta = hf_config.get("rope_theta")
    scaling = hf_config.get("rope_scaling") or {}
    params = hf_config.get("rope_parameters") or {}
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    merged = {**{k: v for k, v in params.items() if k != "rope_theta"}, **scaling}
    items = ";".join(f"{k}={merged[k]}" for k in sorted(merged))
    return f"theta={float(theta)};{items}"


def namespace_for(model_path: str, kv_dtype: str, *, model_id: str | None = None,
                  tp_rank: int = 0, tp_size: int = 1, lora: str = "") -> Namespace:
    """Namespace of ``model_path``'s KV in ``kv_dtype`` for one tensor-parallel rank.

    Raises:
        ValueError: unreadable config, or KV heads not divisible by ``tp_size``.
    """
    try:
        with open(os.path.join(model_path, "config.json")) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read config.json of model {model_path!r}: {e}") from None
    text = cfg.get("text_config", cfg)
    num_heads = int(text["num_attention_heads"])
    num_kv_heads = int(text.get("num_key_value_heads") or num_heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // num_heads)
    if num_kv_heads % tp_size:
        raise ValueError(f"num_kv_heads={num_kv_heads} is not divisible by tp_size={tp_size}")
    return Namespace(
        model_id=model_id or os.path.basename(os.path.normpath(model_path)),
        model_fingerprint=fingerprint_checkpoint(model_path),
        kv_dtype=kv_dtype,
        num_layers=int(text["num_hidden_layers"]),
        num_kv_heads=num_kv_heads // tp_size,
        head_dim=head_dim,
        rope=rope_key(text),
        tp_rank=tp_rank,
        tp_size=tp_size,
        lora=lora,
    )
