"""Who a request's KV belongs to: the tenant part of its chunk keys, or why it is not cached.

vLLM's own prefix cache keys a block on more than its tokens: the LoRA adapter, the request's
``cache_salt`` and its multimodal inputs (``vllm.v1.core.kv_cache_utils``, the "extra keys"
of a block hash). Two prompts with the same tokens under different adapters have different
KV; under different salts they must not read each other's KV even when it is equal (the salt
is how a deployment separates users, e.g. against timing side channels). kvblend keys chunks
the same way: :func:`request_tenant` gives the tenant string that
:func:`tiers.keys.segment_key` and :func:`tiers.keys.prefix_keys` mix into every key of the
request, so requests of different tenants never share a chunk.

- LoRA: the adapter's name and a fingerprint of its files (a BLAKE2b of every file's bytes under
  ``lora_path``, computed once per file identity — path, size, mtime — and cached): an adapter
  retrained under the same name gets new keys. Adapters are small (MiBs), so hashing them
  whole costs little and nothing is sampled.
  A request under an adapter takes the prefix path only (:func:`prefix_only`): its prefix
  chunks are gathered from vLLM's paged cache, which vLLM's forward filled with the adapter
  applied, but a blend segment's canonical KV comes from our own prefill of the segment
  (``cluster.vllm.worker``), which runs the base layers outside vLLM's LoRA batch mapping (it
  failed with a shape error; worse, with a matching shape it would store another adapter's KV).
- ``cache_salt``: the salt itself (it never reaches a log line or a metric label).
- Multimodal inputs and prompt embeddings: not cached at all (their KV depends on inputs the
  token ids do not show): :func:`request_tenant` returns a reason; the scheduler counts it
  (``uncacheable_requests``) and says so once in the log.

Called by :class:`cluster.vllm.scheduler.KVBlendScheduler` on vLLM's scheduler thread, once per
request (the fingerprint of an adapter is hashed on first use).
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

#: Largest adapter folder hashed (bytes); a larger one is keyed by its files' sizes and mtimes.
MAX_HASHED_BYTES = 4 << 30


def request_tenant(request: Any) -> tuple[str, str | None]:
    """``(tenant, reason)`` of a vLLM ``Request``: the tenant string of its chunk keys (``""``:
    the base model, unsalted) and None, or ``("", reason)`` when its KV must not be cached.

    Reads ``request.lora_request`` (``lora_name``, ``lora_path``), ``request.cache_salt``,
    ``request.mm_features`` and ``request.prompt_embeds`` (absent attributes count as unset).
    """
    if getattr(request, "mm_features", None):
        return "", "multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "", "prompt embeddings"
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = str(lora.lora_name)
        fingerprint = adapter_fingerprint(str(getattr(lora, "lora_path", "") or ""))
        if fingerprint.startswith("unreadable"):
            return "", "an unreadable LoRA adapter"
        parts.append(f"lora={len(name)}:{name}:{fingerprint}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={len(str(salt))}:{salt}")
    return ";".join(parts), None


def prefix_only(request: Any, warn) -> bool:
    """True for a request under a LoRA adapter: no blend segments are looked up or stored for
    it (see the module docstring), prefix chunks are; ``warn(key, fmt, *args)`` says so once
    in the log. Where: the scheduler, per request."""
    if getattr(request, "lora_request", None) is None:
        return False
    warn("lora-prefix-only", "kvblend: requests under a LoRA adapter reuse prefix chunks only "
         "(blending under an adapter is not supported yet)")
    return True


def adapter_fingerprint(path: str) -> str:
    """Hex BLAKE2b of a LoRA adapter's files (names and bytes, sorted by name) under ``path``
    (a folder or one file); ``"nopath"`` when there is none to read (the name alone then
    separates adapters). Cached per file identity (path, size, mtime); a read error gives
    ``"unreadable:<error>"`` (the request is then not cached), never an exception."""
    if not path or not os.path.exists(path):
        return "nopath"
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(root, f) for root, _, names in os.walk(path) for f in names)
    h = hashlib.blake2b(digest_size=16, person=b"kvblend-lora")
    total = 0
    for f in files:
        try:
            st = os.stat(f)
            total += st.st_size
            h.update(os.path.relpath(f, path).encode() + b"\0")
            h.update(_file_digest(f, st.st_size, st.st_mtime_ns, total <= MAX_HASHED_BYTES).encode())
        except OSError as e:
            return f"unreadable:{type(e).__name__}"
    return h.hexdigest()


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int, hashed: bool) -> str:
    """One adapter file's digest, computed once per identity (path, size, mtime; the cache is
    bounded); a file past :data:`MAX_HASHED_BYTES` is named by its size and mtime."""
    if not hashed:
        return f"size={size}:mtime={mtime_ns}"
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
