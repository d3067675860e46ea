"""The chunk namespace of a served model, computed the same way by every process.

One function, :func:`namespace_for`, for every caller: the vLLM connector (scheduler and every
worker, with ``model_config.model``, ``.revision``, ``.hf_overrides``, ``.quantization``),
``kvblend ingest``, the demo and ``kvblend bench blend``. It takes the model as the user names
it and resolves it the way vLLM does:

* a **local folder** is used as is;
* anything else is a **Hugging Face Hub id** (``Org/Name``, optional ``revision``), looked up in
  the local Hugging Face cache only (``snapshot_download(local_files_only=True)``, which honours
  ``HF_HOME``/``HF_HUB_CACHE``): the network is never touched, so the namespace is the same with
  ``HF_HUB_OFFLINE=1`` (vLLM then hands us the snapshot folder) and online with the Hub
  unreachable (vLLM hands us the id and loads the cached files itself).

``model_id`` (part of the namespace) is derived from the resolved folder, not from the spelling:
a Hub cache snapshot ``.../models--Org--Name/snapshots/<commit>`` is ``Org/Name``, any other
folder its basename (the bundled ``smollm2`` folder is ``smollm2``). So ``kvblend ingest --model
Org/Name``, ``vllm serve Org/Name`` online and offline, and ``vllm serve`` of the snapshot folder
all give one digest for one set of bytes; a different snapshot (revision) differs by its
fingerprint. The revision string itself is not in the namespace: the bytes it names are.

``hf_overrides`` (a dict, or a JSON string as ``vllm serve --hf-overrides`` takes) is applied to
``config.json`` before the layout and RoPE are read, with vLLM's rules (flat keys replace; a
dict value merges recursively into a sub-config such as ``text_config`` and replaces any other
value, e.g. ``rope_scaling``), and its canonical JSON goes into the namespace. ``quantization``
defaults to the checkpoint's own ``quantization_config.quant_method``, as in vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from tiers.fingerprint import fingerprint_checkpoint
from tiers.keys import Namespace

#: file under the kvblend cache dir that caches checkpoint file digests (:mod:`tiers.fingerprint`)
FINGERPRINT_CACHE = "fingerprints.json"

HfOverrides = Mapping[str, Any] | str | Callable | None


def fingerprint_cache_path(config) -> str:
    """Where processes of this machine share file digests: ``<cache_dir>/fingerprints.json``
    (``config``: a :class:`cluster.config.KVBlendConfig`)."""
    from cluster.config import cache_dir

    return os.path.join(cache_dir(config), FINGERPRINT_CACHE)


def resolve_model_path(model: str, revision: str | None = None, *, hf_cache_dir: str | None = None) -> str:
    """The local folder vLLM loads for ``model``: the folder itself, or a Hub id's cached snapshot.

    Args:
        model: a local folder, or a Hub id (``Org/Name``).
        revision: Hub branch, tag or commit (None: ``main``); ignored for a folder.
        hf_cache_dir: Hugging Face cache (None: ``HF_HUB_CACHE``/``HF_HOME`` as huggingface_hub reads them).

    Raises:
        ValueError: not a folder, and not a Hub id with a complete snapshot in the local cache.
    """
    if os.path.isdir(model):
        return model
    from huggingface_hub import constants, snapshot_download

    try:  # local_files_only: reads refs/<revision> and snapshots/ only, never the network
        folder = snapshot_download(model, revision=revision, cache_dir=hf_cache_dir, local_files_only=True)
        if _has_weights(folder) or constants.HF_HUB_OFFLINE:
            return folder
    except Exception as e:  # noqa: BLE001 - invalid id, not cached, incomplete snapshot
        if constants.HF_HUB_OFFLINE:
            where = hf_cache_dir or constants.HF_HUB_CACHE
            raise ValueError(f"model {model!r} (revision {revision or 'main'}) is neither a directory nor in "
                             f"the local Hugging Face cache {where} ({type(e).__name__}): download it first, "
                             f"e.g. `hf download {model}`") from None
    # Online and not (completely) cached: a fresh pod's vLLM worker builds its connector before
    # the model loader downloads the weights. Download what the loader will load, into the same
    # cache (vLLM then finds it there): config and safetensors, else the other weight formats.
    try:
        folder = snapshot_download(model, revision=revision, cache_dir=hf_cache_dir,
                                   allow_patterns=["*.json", "*.py", "*.safetensors"])
        if not _has_weights(folder):
            folder = snapshot_download(model, revision=revision, cache_dir=hf_cache_dir,
                                       allow_patterns=["*.bin", "*.pt", "*.gguf"])
        return folder
    except Exception as e:  # noqa: BLE001 - invalid id, no network, gated: one message
        where = hf_cache_dir or constants.HF_HUB_CACHE
        raise ValueError(f"model {model!r} (revision {revision or 'main'}) is neither a directory nor in "
                         f"the local Hugging Face cache {where} ({type(e).__name__}): download it first, "
                         f"e.g. `hf download {model}`") from None


def _has_weights(folder: str) -> bool:
    from tiers.fingerprint import WEIGHT_SUFFIXES

    return any(n.endswith(WEIGHT_SUFFIXES) for n in os.listdir(folder))


def model_id_of(folder: str) -> str:
    """``Org/Name`` for a Hub cache snapshot folder (``models--Org--Name/snapshots/<commit>``;
    Hub ids cannot contain ``--``, so the name decodes uniquely), else the folder's basename."""
    path = os.path.normpath(os.path.abspath(folder))
    parent, snapshots = os.path.split(os.path.dirname(path))
    repo = os.path.basename(parent)
    if snapshots == "snapshots" and repo.startswith("models--"):
        return "/".join(repo.split("--")[1:])
    return os.path.basename(path)


def canonical_overrides(hf_overrides: HfOverrides) -> tuple[dict[str, Any], str]:
    """``(overrides as a dict, canonical JSON for the namespace)``; ``({}, "")`` for none.

    A callable (vLLM's Python API accepts ``hf_overrides=fn``) cannot be applied to a JSON
    config: the layout is read without it and the namespace holds ``callable:<module.qualname>``.

    Raises:
        ValueError: a string that is not a JSON object, or a value of another type.
    """
    if hf_overrides is None or hf_overrides == "" or hf_overrides == {}:
        return {}, ""
    if callable(hf_overrides):
        fn = hf_overrides
        return {}, f"callable:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    if isinstance(hf_overrides, str):
        try:
            hf_overrides = json.loads(hf_overrides)
        except ValueError as e:
            raise ValueError(f"hf_overrides={hf_overrides!r} is not JSON: {e}") from None
    if not isinstance(hf_overrides, Mapping):
        raise ValueError(f"hf_overrides={hf_overrides!r}: expected a JSON object (dict)")
    overrides = json.loads(json.dumps(dict(hf_overrides), default=str))  # plain JSON values
    if not overrides:
        return {}, ""
    return overrides, json.dumps(overrides, sort_keys=True, separators=(",", ":"))


def apply_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
    """Apply ``overrides`` to ``config`` (a ``config.json`` dict or a transformers config object)
    in place with vLLM's rules (``ModelConfig._apply_dict_overrides``): a dict value merges
    recursively into a sub-config (an object, or in JSON a dict with a ``model_type`` or a
    ``*_config`` key other than ``quantization_config``); any other value replaces. Returns ``config``."""
    for key, value in overrides.items():
        current = _get(config, key)
        if isinstance(value, Mapping) and _is_sub_config(key, current):
            _update_nested(current, value)
        else:
            _set(config, key, value)
    return config


def _get(target: Any, key: str) -> Any:
    return target.get(key) if isinstance(target, dict) else getattr(target, key, None)


def _set(target: Any, key: str, value: Any) -> None:
    if isinstance(target, dict):
        target[key] = value
    else:
        setattr(target, key, value)


def _is_sub_config(key: str, current: Any) -> bool:
    if isinstance(current, dict):
        return "model_type" in current or (key.endswith("_config") and key != "quantization_config")
    return current is not None and hasattr(current, "to_dict") and hasattr(current, "__dict__")


def _update_nested(target: Any, updates: Mapping[str, Any]) -> None:
    """vLLM's ``ModelConfig._update_nested``: dicts merge into existing dicts/objects, else set."""
    for key, value in updates.items():
        nested = _get(target, key)
        if isinstance(value, Mapping) and nested is not None and (isinstance(nested, dict) or hasattr(nested, "__dict__")):
            _update_nested(nested, value)
        else:
            _set(target, key, value)


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


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one tensor-parallel rank holds, as vLLM shards them: ``num_kv_heads / tp_size``,
    or 1 when ``tp_size`` is a multiple of ``num_kv_heads`` (each head is then replicated on
    ``tp_size / num_kv_heads`` ranks, whose KV is identical; each rank still keys its own copy).

    Raises:
        ValueError: neither divides the other (vLLM refuses that layout too), or ``tp_size < 1``.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size={tp_size} must be >= 1")
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return 1
    raise ValueError(f"num_kv_heads={num_kv_heads} and tp_size={tp_size}: one must divide the other")


def read_model_config(path: str) -> dict:
    """``<path>/config.json`` as a dict. Raises ValueError when unreadable."""
    try:
        with open(os.path.join(path, "config.json")) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read config.json of model {path!r}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config.json of model {path!r} is not a JSON object")
    return cfg


def namespace_for(model: str, kv_dtype: str, *, revision: str | None = None, hf_overrides: HfOverrides = None,
                  quantization: str | None = None, model_id: str | None = None, tp_rank: int = 0,
                  tp_size: int = 1, lora: str = "", fingerprint_cache: str | None = None,
                  hf_cache_dir: str | None = None) -> Namespace:
    """Namespace of ``model``'s KV in ``kv_dtype`` for one tensor-parallel rank.

    Args:
        model: as the user names it to vLLM: a local folder or a Hub id (see the module docstring).
        kv_dtype: torch dtype name of the stored KV (the served dtype), e.g. ``float32``.
        revision: Hub revision (vLLM's ``model_config.revision``); ignored for a folder.
        hf_overrides: vLLM's ``hf_overrides`` (dict, JSON string or callable; see
            :func:`canonical_overrides`).
        quantization: vLLM's ``quantization`` (None: the checkpoint's ``quant_method``, else "").
        model_id: overrides the id derived from the folder (:func:`model_id_of`).
        tp_rank, tp_size: tensor-parallel rank and world size.
        lora: LoRA adapter name ('' for the base model).
        fingerprint_cache: JSON file caching file digests (:func:`fingerprint_cache_path`; None:
            this process only). The first call per file identity reads every byte of the weights.
        hf_cache_dir: Hugging Face cache for Hub ids (None: huggingface_hub's default).

    Raises:
        ValueError: a model that resolves to no folder, an unreadable ``config.json`` or model
            file, malformed ``hf_overrides``, or KV heads and ``tp_size`` that do not divide.
    """
    path = resolve_model_path(model, revision, hf_cache_dir=hf_cache_dir)
    overrides, overrides_key = canonical_overrides(hf_overrides)
    cfg = apply_overrides(read_model_config(path), overrides)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    try:
        num_heads = int(text["num_attention_heads"])
        num_kv_heads = int(text.get("num_key_value_heads") or num_heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // num_heads)
        num_layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"config.json of model {path!r} lacks a decoder layout ({type(e).__name__}: {e})") from None
    quant_config = cfg.get("quantization_config")
    if quantization is None and isinstance(quant_config, dict):
        quantization = quant_config.get("quant_method")
    return Namespace(
        model_id=model_id or model_id_of(path),
        model_fingerprint=fingerprint_checkpoint(path, fingerprint_cache),
        kv_dtype=kv_dtype,
        num_layers=num_layers,
        num_kv_heads=kv_heads_per_rank(num_kv_heads, tp_size),
        head_dim=head_dim,
        rope=rope_key(text),
        tp_rank=tp_rank,
        tp_size=tp_size,
        lora=lora,
        overrides=overrides_key,
        quantization=str(quantization or ""),
    )
