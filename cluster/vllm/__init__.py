"""kvblend inside stock vLLM: the KV connector, the model hook and the paged-cache views.

`connector` is the ``KVConnectorBase_V1`` vLLM loads (``cluster.connector`` re-exports it): a
thin facade over a `scheduler` half and a `worker` half (with its `store_queue`) that talk
through `metadata`, configured by `options` and reporting through `events` and `metrics`
(`tp_lookup`: the scheduler's lookups under tensor parallelism).
`worker_source` is the worker's KV source (gpu tier in front of the cache client), `paged` reads
and writes vLLM's paged KV layouts, `model_hook` and `plugin` let the worker reach the model
vLLM built, `affinity` keeps our threads off vLLM's pinned core, and `offline` drives an
in-process ``vllm.LLM``. Importing this package imports no vLLM code; `connector`, `metadata`,
`metrics` and `model_hook` do at import time (through them `scheduler` and `worker` too; `offline`
and `plugin` only inside their functions).
"""
