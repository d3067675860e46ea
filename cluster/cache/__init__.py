"""The Ray-hosted chunk cache: shard actors, how to reach them, and the clients that read them.

`shard` is the ``CacheShard`` actor (host tier in Ray's object store, disk/Redis/S3 below it),
`lifecycle` names, starts, finds and stops the shard actors (`identity` names and locks their
disk directories after a stable node name), `connect` joins (or starts) Ray,
`placement` maps chunk keys to shards and `metrics` exports the shards' Prometheus metrics.
`protocol` is the one client contract (blend's KV source and sink plus administration) that
`client` (over Ray: `router` reaches the owning shards, `puts` sends and flushes the writes)
and `local` (one process, no Ray) implement, and `factory.make_client` picks one of them;
nothing here imports the vLLM, CLI, workload or benchmark wings.
"""
