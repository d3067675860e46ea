"""The Ray-hosted chunk cache: shard actors, placement and the clients that read them.

`shard` is the ``CacheShard`` actor (host tier in Ray's object store, disk/Redis/S3 below
it), `placement` maps chunk keys to shards, `connect` joins Ray, and `client` (Ray) and
`local` (one machine, no Ray) are the two implementations of blend's KV source that callers
get from one factory. `metrics` exports the shards' Prometheus counters. Nothing here imports
vLLM or the vLLM wing.
"""
