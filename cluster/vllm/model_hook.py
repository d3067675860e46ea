"""How the connector reaches vLLM's model without patching vLLM: tracking model classes.

vLLM's KV connector API hands a connector the paged KV caches, never the model, and CacheBlend
needs the model's own layers (fused ``qkv_proj``, ``rotary_emb``, ``o_proj``, norms, MLP). The
supported hook used here is vLLM's **model registry**: the ``vllm.general_plugins`` entry point
(:func:`cluster.vllm.plugin.register`, run by vLLM in every process before a model is built)
re-registers the architectures below with subclasses that differ from vLLM's classes in one
thing only: ``__init__`` records the instance in this process's registry. A worker-side
connector then finds the model of its own process with :func:`current_model`.

The subclasses change no computation, weight loading or config handling; serving without the
kvblend connector behaves exactly as stock vLLM. LMCache instead asks users to edit vLLM's
worker to register the model, an edit that broke across vLLM versions.
"""

from __future__ import annotations

import threading
import weakref

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

_lock = threading.Lock()
_models: list[weakref.ref] = []

#: architecture name (HF ``config.architectures``) -> class name in this module.
TRACKED_ARCHITECTURES = {
    "LlamaForCausalLM": "KVBlendLlamaForCausalLM",
    "Qwen2ForCausalLM": "KVBlendQwen2ForCausalLM",
}


def _track(model) -> None:
    with _lock:
        _models[:] = [r for r in _models if r() is not None]
        _models.append(weakref.ref(model))


def current_model():
    """The vLLM model built most recently in this process (a tracked architecture).

    Raises:
        RuntimeError: no tracked model was built in this process (the kvblend plugin was not
            loaded, or the architecture is not in :data:`TRACKED_ARCHITECTURES`).
    """
    with _lock:
        alive = [m for m in (r() for r in _models) if m is not None]
    if not alive:
        raise RuntimeError(
            "kvblend: no vLLM model registered in this process; blending needs the "
            "'kvblend' vllm.general_plugins entry point (pip install kvblend) and an architecture "
            f"in {sorted(TRACKED_ARCHITECTURES)}")
    return alive[-1]


class KVBlendLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's ``LlamaForCausalLM``, recorded for :func:`current_model`."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        _track(self)


class KVBlendQwen2ForCausalLM(Qwen2ForCausalLM):
    """vLLM's ``Qwen2ForCausalLM``, recorded for :func:`current_model`."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        _track(self)
