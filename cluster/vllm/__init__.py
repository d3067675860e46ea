"""kvblend inside stock vLLM: the KV connector, the model hook and the paged-cache views.

`connector` is the ``KVConnectorBase_V1`` vLLM loads (``cluster.connector`` re-exports it);
`worker_source` is the worker's KV source (gpu tier in front of the cache client), `paged`
reads and writes vLLM's paged KV layouts, `model_hook` and `plugin` let the worker reach the
model vLLM built, and `events` reads the connector's per-request events from other processes.
Importing this package imports no vLLM code; its modules do.
"""
