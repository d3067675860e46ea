"""kvblend's data plane: chunk keys, the chunk object format, and the tiers that hold chunks.

`keys` names what makes KV interchangeable (Namespace) and what a chunk holds (ChunkKey);
`format` is the layer-addressable, checksummed chunk object; `tier` states the Tier protocol.
The host, disk, Redis, S3 and gpu tiers, their eviction index, the stack that composes them,
the reader and the GPU staging source build on those three.
"""
