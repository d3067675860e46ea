"""Chunk keys: what makes cached KV interchangeable (the namespace) plus what it holds (content).

A :class:`ChunkKey` is ``<namespace digest>/<kind>/<content hash>``:

* the **namespace** pins everything that makes two KV tensors interchangeable: model id and
  checkpoint fingerprint, LoRA adapter, KV dtype, KV layout (layers, KV heads, head dim),
  tensor-parallel rank and size, RoPE parameters, config overrides and quantization method,
  and the chunk-format version;
* ``kind`` is ``seg`` for a blend segment (position-independent: the hash covers the
  segment's token ids only, so the same passage anywhere in any prompt has one key, whatever
  its length) or ``pre`` for an ordinary prefix chunk of ``chunk_size`` tokens (the hash is
  chained over all earlier chunks, as in vLLM's prefix caching);
* hashes are BLAKE2b of little-endian int32/int64 token bytes: stable across processes and
  machines (never Python's ``hash()``).

Bookkeeping only: no torch here.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

#: Version of the chunk object format (tiers.format); part of every namespace. 2: object
#: authentication (tiers.auth).
FORMAT_VERSION = 2

SEGMENT = "seg"
PREFIX = "pre"
_KINDS = (SEGMENT, PREFIX)
#: what a key's namespace and content may hold (they become file names and object keys)
_KEY_PART = re.compile(r"[0-9A-Za-z_-]{1,128}")


@dataclass(frozen=True)
class Namespace:
    """What makes KV interchangeable. Two processes build equal namespaces for the same model.

    Attributes:
        model_id: served model name (``smollm2``, a Hub id ``Org/Name`` or a folder's basename;
            :func:`cluster.namespace.namespace_for` says which).
        model_fingerprint: checkpoint fingerprint over every byte of its files
            (:func:`tiers.fingerprint.fingerprint_checkpoint`).
        kv_dtype: torch dtype name of stored KV, e.g. ``bfloat16``.
        num_layers: decoder layers.
        num_kv_heads: KV heads *of this rank* (total / tp_size; 1 when tp_size exceeds the
            total and vLLM replicates each head on tp_size / total ranks).
        head_dim: per-head dimension.
        rope: canonical string of the RoPE parameters (theta, scaling type and factors).
        tp_rank: tensor-parallel rank (0..tp_size-1).
        tp_size: tensor-parallel world size.
        lora: LoRA adapter name or '' for the base model.
        format_version: chunk-format version (:data:`FORMAT_VERSION`).
        overrides: canonical JSON of the config overrides the model is served with (vLLM's
            ``hf_overrides``), ``""`` for none.
        quantization: weight quantization method (vLLM's ``quantization``, e.g. ``fp8``), ``""``
            for none.
    """

    model_id: str
    model_fingerprint: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    lora: str = ""
    format_version: int = FORMAT_VERSION
    overrides: str = ""
    quantization: str = ""

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"tp_rank={self.tp_rank} must be in 0..tp_size-1 (tp_size={self.tp_size})")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")

    def digest(self) -> str:
        """16 hex chars identifying this namespace (stable across processes)."""
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()


@dataclass(frozen=True, order=True)
class ChunkKey:
    """Key of one chunk object: ``namespace``/``kind``/``content``.

    ``namespace`` and ``content`` are 1-128 characters of ``[0-9A-Za-z_-]`` (ours are hex
    digests): no ``/``, ``.``, NUL or whitespace, so no key can name a path outside the disk
    tier's directory (``..``) or a file the OS refuses. Raises ``ValueError`` otherwise.
    """

    namespace: str
    kind: str
    content: str

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"ChunkKey kind={self.kind!r}: expected one of {_KINDS}")
        for part in (self.namespace, self.content):
            if not isinstance(part, str) or not _KEY_PART.fullmatch(part):
                raise ValueError(f"ChunkKey part {part!r}: expected 1-128 characters of "
                                 "[0-9A-Za-z_-] (no '/', '.', NUL or whitespace)")

    def __str__(self) -> str:
        return f"{self.namespace}/{self.kind}/{self.content}"

    @classmethod
    def parse(cls, text: str) -> ChunkKey:
        """Inverse of ``str(key)``. Raises ValueError on a malformed string."""
        parts = text.split("/")
        if len(parts) != 3:
            raise ValueError(f"malformed chunk key {text!r}: expected namespace/kind/content")
        return cls(*parts)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    return arr.astype("<i8", copy=False).tobytes()


def _tenant_salt(tenant: str) -> bytes:
    """The 16-byte BLAKE2b salt of a tenant: empty for the base model with no ``cache_salt``
    (keys as before tenants existed), else a digest of the tenant string."""
    return b"" if not tenant else hashlib.blake2b(tenant.encode(), digest_size=16, person=b"kvblend-ten").digest()


def segment_key(namespace: str, token_ids: Sequence[int], tenant: str = "") -> ChunkKey:
    """Position-independent key of a blend segment (its token ids only).

    ``tenant``: what besides the tokens changes the KV or who may read it (a LoRA adapter and
    its weights, vLLM's ``cache_salt``, as the serving layer names them): requests of
    different tenants never share a key. ``""``: the base model, unsalted.

    Raises:
        ValueError: empty ``token_ids``.
    """
    if len(token_ids) == 0:
        raise ValueError("a segment key needs at least one token")
    h = hashlib.blake2b(_token_bytes(token_ids), digest_size=16, person=b"kvblend-seg", salt=_tenant_salt(tenant))
    return ChunkKey(namespace, SEGMENT, h.hexdigest())


def prefix_keys(namespace: str, token_ids: Sequence[int], chunk_size: int, tenant: str = "") -> list[ChunkKey]:
    """Prefix-chained keys of the full ``chunk_size`` chunks of ``token_ids``.

    Key i covers tokens ``[0, (i+1)*chunk_size)``: it hashes chunk i's tokens and key i-1.
    A trailing partial chunk gets no key. ``tenant``: as :func:`segment_key`.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    keys: list[ChunkKey] = []
    parent = b""
    salt = _tenant_salt(tenant)
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        h = hashlib.blake2b(parent + _token_bytes(token_ids[start:start + chunk_size]),
                            digest_size=16, person=b"kvblend-pre", salt=salt)
        parent = h.digest()
        keys.append(ChunkKey(namespace, PREFIX, h.hexdigest()))
    return keys
