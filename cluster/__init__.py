"""kvblend's running system: the Ray-sharded cache, the vLLM integration, and what runs on them.

`cache` is the Ray cache service (shard actors, placement, the clients that implement blend's
KV source), `vllm` the KV connector inside stock vLLM, `workloads` the model, QA data, replicas,
ingest and the demo, `cli` the ``kvblend`` commands and `bench` the benchmarks; each wing
imports only the ones below it (cli and bench -> workloads -> vllm -> cache). `config`/`env`
compose and read the settings, `namespace` names what makes KV interchangeable, and
`connector` re-exports the connector for ``kv_connector_module_path: cluster.connector``.
"""
