"""vLLM general plugin ``kvblend`` (entry point ``vllm.general_plugins``: ``cluster.vllm.plugin:register``).

vLLM calls :func:`register` in each of its processes (front end, engine core, workers) before
it builds a model. It does three things, both through public vLLM APIs:

* registers :class:`cluster.vllm.connector.KVBlendConnector` with ``KVConnectorFactory`` under the
  short name ``KVBlendConnector``, so ``--kv-transfer-config '{"kv_connector":"KVBlendConnector",
  "kv_role":"kv_both"}'`` works without ``kv_connector_module_path``;
* re-registers the architectures of :data:`cluster.vllm.model_hook.TRACKED_ARCHITECTURES` with
  ``ModelRegistry`` as tracking subclasses (lazily, by ``module:class`` string), the hook by
  which the worker-side connector reaches the model (see :mod:`cluster.vllm.model_hook`);
* registers the tokenizer mode ``kvblend`` (``--tokenizer-mode kvblend``: each segment of a
  blend prompt tokenized on its own, :mod:`cluster.vllm.segment_tokenizer`).

Both are idempotent; importing this module imports no vLLM code.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVBlendConnector"
#: the module path vLLM configs name (a re-export of :mod:`cluster.vllm.connector`)
CONNECTOR_MODULE = "cluster.connector"
_registered = False


def register() -> None:
    """Register the kvblend connector and the model-tracking classes with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    from cluster.vllm.model_hook import TRACKED_ARCHITECTURES

    for arch, cls_name in TRACKED_ARCHITECTURES.items():
        ModelRegistry.register_model(arch, f"cluster.vllm.model_hook:{cls_name}")
    from cluster.vllm.segment_tokenizer import register as register_segment_tokenizer

    register_segment_tokenizer()
    _registered = True
