"""The Ray-hosted chunk cache: shard actors, how to reach them, and the one client that reads them.

`shard` is the ``CacheShard`` actor (host tier in Ray's object store, disk/Redis/S3 below it),
`lifecycle` names, starts, finds and stops the shard actors (`identity` names and locks their
disk directories after a stable node name), `connect` joins (or starts) Ray,
`placement` maps chunk keys to shards and `metrics` exports the shards' Prometheus metrics.
`protocol` is the client contract (blend's KV source and sink plus administration) that the one
`client` (``CacheClient``: headers, held objects, checks, counters, put bound, direct Redis/S3
reads) keeps over a chain of transports, each op declared once in `ops`: `ray_transport` (the
shards from this process: `router` reaches the owning shards, `puts` sends the writes), the
`agent_transport` and `local` (a tier in this process); `factory.make_client` picks the chain.
The vLLM connector's default chain is the agent, then the machine-local cache: Ray runs in a
child `agent` (a Ray driver dies with a lost head; vLLM must not), reached over `wire` (frames,
deadlines, heartbeats; `agent_life` starts and restarts it); chunk objects come back through the
shared-memory `arena` that vLLM's process owns (`agent_objects`); a put carries the chunk object
encoded once in vLLM's process. One request's path with the hop through the agent::

    vLLM process                                   agent process          shard actor
    CacheClient.lookup ---- AgentTransport --socket (wire)--> Agent: RayTransport --Ray--> CacheShard
      headers parsed here, once per key              ops forwarded as typed requests
    CacheClient.fetch_layers -- objects --socket--> mapped from the object store (zero-copy)
      layers sliced and copied here <--arena slot (one memcpy by the agent)--
    CacheClient.put (encoded once) --socket--> forwarded as it came --Ray--> host tier, then
                                                                             disk/Redis/S3

Nothing here imports the vLLM, CLI, workload or benchmark wings.
"""
