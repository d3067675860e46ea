"""kvblend's running system: configuration, the Ray-sharded cache, and the vLLM integration.

`config`/`env` compose and read the settings; `shard`, `placement`, `client` and `ray_util`
are the Ray cache shards and the client that implements blend's KVSource; `connector`,
`vllm_model` and `vllm_plugin` put the blend engine inside stock vLLM. The CLI (`cli`) runs
`server`, `status`, `stop`, `clear`, `ingest`, `demo`, `model prepare` and the benchmarks.
"""
