"""Below host memory: objects re-encoded for the lower tiers, and the shared tiers.

:func:`recode` re-encodes a chunk object with lz4 per layer (where it pays: see
:mod:`tiers.format`) or with every layer raw; :class:`tiers.stack.TierStack` stores objects
below its top tier that way. :func:`shared_tiers` opens the shared tiers (Redis, S3) of a
:class:`tiers.config.TiersConfig`, leaving out any that cannot be opened: used by
:meth:`tiers.stack.TierStack.from_config`, by every cache shard (below its disk) and by a
cluster client that reads them directly when a chunk's owner shard is dead.
"""

from __future__ import annotations

import importlib
import logging

from tiers.format import CODEC_LZ4, ChunkHeader, decode_layer, encode_chunk
from tiers.keys import ChunkKey
from tiers.reader import validate_object
from tiers.redact import MASK, redact_text, redact_url
from tiers.tier import Buffer, Tier

log = logging.getLogger(__name__)

_SHARED = (("redis", "redis_url", "tiers.redis_tier", "RedisTier"),
           ("s3", "s3_url", "tiers.s3", "S3Tier"))


def recode(obj: Buffer, key: ChunkKey, compress: bool,
           header: ChunkHeader | None = None) -> bytes | Buffer:
    """Return ``obj`` re-encoded with lz4 per layer (``compress=True``) or with every layer
    raw (``False``); ``obj`` itself when it already is in that form.

    Args:
        header: ``validate_object(obj, key)``'s result when the caller already checked it.

    Raises:
        FormatError: ``obj`` is not a valid object of ``key``.
    """
    if header is None:
        header = validate_object(obj, key)
    has_lz4 = any(e.codec == CODEC_LZ4 for e in header.layers)
    if has_lz4 == compress:
        return obj
    view = memoryview(obj).cast("B")
    layers = [decode_layer(header, i, view[e.offset:e.offset + e.stored_len])
              for i, e in enumerate(header.layers)]
    return encode_chunk(key, layers, dtype=header.dtype, num_tokens=header.num_tokens,
                        num_kv_heads=header.num_kv_heads, head_dim=header.head_dim,
                        positions=header.position_list(), compress=compress)


def shared_tiers(cfg) -> list[Tier]:
    """The shared tiers (Redis, then S3) that ``cfg`` configures (a non-empty URL each).

    A tier whose module is missing (``redis``/``boto3`` not installed) or whose constructor
    fails (e.g. a malformed URL) is left out with a warning (its reads are then misses),
    never an exception. The warning masks a password in the URL (:mod:`tiers.redact`).
    """
    out: list[Tier] = []
    for kind, field, module, cls_name in _SHARED:
        url = getattr(cfg, field)
        if not url:
            continue
        try:
            out.append(getattr(importlib.import_module(module), cls_name).from_config(cfg))
        except Exception as e:  # noqa: BLE001 - a broken shared tier degrades to misses
            why = redact_text(str(e), url)
            for secret in (getattr(cfg, "redis_password", ""),):  # given apart from the URL
                why = why.replace(secret, MASK) if secret else why
            log.warning("%s tier %s unavailable: %s", kind, redact_url(url), why)
    return out
