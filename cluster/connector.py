"""The name vLLM configurations use: ``kv_connector_module_path="cluster.connector"``.

README, Helm chart and users' ``--kv-transfer-config`` name this module; the connector lives
in :mod:`cluster.vllm.connector`. This module only re-exports it, so both paths load the
same class.
"""

from cluster.vllm.connector import KVBlendConnector, KVBlendConnectorMetadata

__all__ = ["KVBlendConnector", "KVBlendConnectorMetadata"]
