"""The Ray-hosted chunk cache: shard actors, how to reach them, and the clients that read them.

`shard` is the ``CacheShard`` actor (host tier in Ray's object store, disk/Redis/S3 below it),
`lifecycle` names, starts, finds and stops the shard actors (`identity` names and locks their
disk directories after a stable node name), `connect` joins (or starts) Ray,
`placement` maps chunk keys to shards and `metrics` exports the shards' Prometheus metrics.
`protocol` is the one client contract (blend's KV source and sink plus administration) that
`client` (over Ray: `router` reaches the owning shards, `puts` sends and flushes the writes)
and `local` (one process, no Ray) implement, and `factory.make_client` picks one of them.
The vLLM connector's default is `agent_client`: Ray runs in a child `agent` (a Ray driver dies
with a lost head; vLLM must not), reached over `wire` (frames, deadlines, heartbeats) with the
operations `agent_ops` declares once for both ends; chunk objects come back through the
shared-memory `arena` that vLLM's process owns, held by `agent_objects`; a put carries the
chunk object encoded once in vLLM's process::

    vLLM process: AgentClient --socket (wire)--> agent: CacheClient --Ray--> CacheShard
                  AgentObjects <--arena (one memcpy)-- agent copies the mapped object

Nothing here imports the vLLM, CLI, workload or benchmark wings.
"""
