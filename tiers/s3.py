"""The S3 tier: one object per chunk in an S3 bucket (or any S3-compatible store).

* Object key ``<prefix><namespace>/<kind>/<content>`` from ``s3://bucket/prefix``. The
  namespace is the first path component after the prefix, so a lifecycle rule on
  ``<prefix>`` (or on one namespace) expires old chunks: S3 has no per-object TTL; set an
  expiration rule on the bucket, e.g. 30 days, for a cache (kvblend never needs an object
  that is gone: it is a miss and a recompute).
* ``put``: ``PutObject`` with ``If-None-Match: *`` (first complete object wins; S3 applies a
  PUT atomically, so readers never see a torn object). Objects over
  ``multipart_threshold_bytes`` go through boto3's managed transfer (multipart, parallel
  parts) after a ``HeadObject`` check, since the managed upload does not take
  ``If-None-Match``; two racing writers then both upload the same complete bytes.
  Stores that reject conditional writes (501/NotImplemented) fall back to head-then-put.
* Layer reads are ranged ``GetObject`` (adjacent ranges coalesced into one request) and
  :meth:`S3Tier.get_ranges_into` streams a response straight into the caller's buffer.
* ``contains`` is ``HeadObject`` per key on a small thread pool.
* :meth:`S3Tier.clear` (``kvblend clear --shared``) deletes the chunk objects of one
  namespace, or all, under the prefix: ``ListObjectsV2`` (paginated) on
  ``<prefix>[<namespace>/]``, only keys whose rest parses as a chunk key and whose objects read
  as our chunk objects (:mod:`tiers.ownership`), ``DeleteObjects`` up to 1000 keys a request.
* boto3 client with ``retries={"mode": "standard"}`` (exponential backoff with jitter for
  throttling and 5xx), ``endpoint_url`` for S3-compatible stores; credentials from the
  standard AWS chain (environment, config files, instance/IRSA roles), never logged.

Failure behaviour: connect and read timeouts are ``timeout_s`` per attempt, with up to
``max_attempts`` attempts. After the retries, any error (throttling, 5xx, a dead endpoint,
``InvalidRange``, bad credentials) is a miss / a failed put, counted in
``stats()['errors']``; a missing object (404) counts ``misses``. Nothing raises to the
caller except caller mistakes (``ValueError``) and the administrative :meth:`S3Tier.clear`,
which raises ``OSError`` so that ``kvblend clear`` can report a failed clear.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tiers.format import PREFIX_BYTES
from tiers.keys import ChunkKey
from tiers.ownership import Cleared, check_bytes, classify, deletable
from tiers.redact import redact_url
from tiers.tier import Buffer

log = logging.getLogger(__name__)

_COUNTERS = ("hits", "misses", "errors", "puts", "oversized", "bytes_read", "bytes_written")
_MISSING = ("NoSuchKey", "404", "NotFound")
_ALREADY = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
_NO_CONDITIONAL = ("NotImplemented", "501")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` -> ``(bucket, prefix)`` with the prefix ending in ``/`` (or '').

    Raises:
        ValueError: not an ``s3://`` URL or no bucket.
    """
    if not url.startswith("s3://"):
        raise ValueError(f"s3 url {redact_url(url)!r} must start with s3://")
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise ValueError(f"s3 url {redact_url(url)!r} names no bucket")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/" if prefix else "")


class S3Tier:
    """Chunk objects in S3 (see module docstring).

    Args:
        url: ``s3://bucket[/prefix]``.
        endpoint_url: endpoint of an S3-compatible store ('' or None = AWS).
        region: region name ('' or None = from the standard chain).
        timeout_s: connect and read timeout per attempt, seconds.
        max_attempts: attempts per request including the first (standard retry mode).
        multipart_threshold_bytes: objects at least this large use multipart upload.
        max_workers: threads for batch ``contains`` and multipart transfers.
        name: tier name in stats.
        max_object_bytes: the most bytes a whole-object :meth:`get` reads (0 = only the bound
            its caller gives: :func:`tiers.reader.read_object` gives the object's own size from
            its header); a longer object is a miss counted in ``oversized``.

    Raises:
        ValueError: malformed URL, non-positive timeout/attempts or negative max_object_bytes.
    """

    def __init__(self, url: str, endpoint_url: str | None = None, region: str | None = None,
                 timeout_s: float = 5.0, *, max_attempts: int = 3,
                 multipart_threshold_bytes: int = 64 << 20, max_workers: int = 8,
                 name: str = "s3", max_object_bytes: int = 0) -> None:
        import boto3
        import botocore.exceptions
        import urllib3.exceptions
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if timeout_s <= 0 or max_attempts < 1 or max_object_bytes < 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0, max_attempts={max_attempts} >= 1 "
                             f"and max_object_bytes={max_object_bytes} >= 0")
        #: the most bytes a whole-object read takes (0: only the caller's bound)
        self.max_object_bytes = int(max_object_bytes)
        self.name = name
        self.bucket, self.prefix = parse_s3_url(url)
        self._botocore_exc = botocore.exceptions
        # what a body read can raise (botocore's transport is urllib3)
        self._stream_errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError,
                               urllib3.exceptions.HTTPError, ValueError)
        config = Config(retries={"max_attempts": max_attempts, "mode": "standard"},
                        connect_timeout=timeout_s, read_timeout=timeout_s,
                        max_pool_connections=max(10, 2 * max_workers))
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url or None, region_name=region or None, config=config)
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold_bytes,
                                        multipart_chunksize=max(8 << 20, multipart_threshold_bytes // 4),
                                        max_concurrency=max_workers, use_threads=True)
        self._threshold = multipart_threshold_bytes
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="s3tier")
        self._conditional = True
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(_COUNTERS, 0)

    @classmethod
    def from_config(cls, cfg) -> S3Tier:
        """From a :class:`tiers.config.TiersConfig` (``s3_url``, ``s3_endpoint_url``,
        ``s3_region``, ``io_timeout_s``, ``max_object_mib``)."""
        return cls(cfg.s3_url, cfg.s3_endpoint_url, cfg.s3_region, cfg.io_timeout_s,
                   max_object_bytes=int(cfg.max_object_mib * 2**20))

    def _okey(self, key: ChunkKey) -> str:
        return f"{self.prefix}{key}"

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _code(self, e: Exception) -> str:
        if isinstance(e, self._botocore_exc.ClientError):
            err = e.response.get("Error", {})
            return str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return type(e).__name__

    def _fail(self, op: str, key: object, e: Exception) -> None:
        code = self._code(e)
        if code in _MISSING:
            self._count("misses")
            return
        log.debug("s3 tier %s %s failed: %s", op, key, code)  # never the credentials
        self._count("errors")

    def _errors(self) -> tuple[type[BaseException], ...]:
        return (self._botocore_exc.BotoCoreError, self._botocore_exc.ClientError, OSError)

    # -- Tier ----------------------------------------------------------------------------
    def _exists(self, key: ChunkKey) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._okey(key))
            return True
        except self._errors() as e:
            if self._code(e) not in _MISSING:
                self._fail("contains", key, e)
            return False

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """HeadObject per key, in parallel. An error reads as absent (counted)."""
        if len(keys) <= 1:
            return [self._exists(k) for k in keys]
        return list(self._pool.map(self._exists, keys))

    def put(self, key: ChunkKey, obj: Buffer) -> bool:
        view = memoryview(obj).cast("B")
        try:
            if view.nbytes >= self._threshold or not self._conditional:
                if self._exists(key):
                    return True
                self._client.upload_fileobj(io.BytesIO(view), self.bucket, self._okey(key),
                                            Config=self._transfer)
            else:
                body = obj if isinstance(obj, bytes) else view.tobytes()
                try:
                    self._client.put_object(Bucket=self.bucket, Key=self._okey(key), Body=body,
                                            IfNoneMatch="*")
                except self._botocore_exc.ClientError as e:
                    code = self._code(e)
                    if code in _ALREADY:
                        return True  # someone stored the complete object first
                    if code not in _NO_CONDITIONAL:
                        raise
                    log.info("s3 tier: store rejects If-None-Match; falling back to head-then-put")
                    self._conditional = False
                    return self.put(key, obj)
        except self._errors() as e:
            self._fail("put", key, e)
            return False
        with self._lock:
            self._stats["puts"] += 1
            self._stats["bytes_written"] += view.nbytes
        return True

    def _get(self, key: ChunkKey, range_: str | None):
        kwargs = {"Bucket": self.bucket, "Key": self._okey(key)}
        if range_ is not None:
            kwargs["Range"] = range_
        return self._client.get_object(**kwargs)

    def open_stream(self, key: ChunkKey) -> _Body | None:
        """The whole object as a stream (one GetObject) with ``readinto``/``close`` and
        ``length`` (its ContentLength), or None.
        The stream's read errors surface as ``OSError`` (and count in ``errors``), so one
        request serves a whole-chunk read: header, then layers straight into buffers."""
        try:
            response = self._get(key, None)
        except self._errors() as e:
            self._fail("open_stream", key, e)
            return None
        self._hit(0)
        length = response.get("ContentLength")
        return _Body(self, response["Body"], None if length is None else int(length))

    def get(self, key: ChunkKey, max_bytes: int | None = None) -> bytes | None:
        """The whole object, or None (missing, an error). An object longer than ``max_bytes``
        (when given) or than :attr:`max_object_bytes` (when set) is a miss counted in
        ``oversized``, found from the response's ``ContentLength`` before its body is read (the
        body is closed unread), or, without one, after reading at most the bound + 1 bytes.

        Raises:
            ValueError: ``max_bytes`` is not positive.
        """
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be positive")
        if self.max_object_bytes:
            max_bytes = self.max_object_bytes if max_bytes is None else min(max_bytes, self.max_object_bytes)
        try:
            response = self._get(key, None)
            if max_bytes is not None and int(response.get("ContentLength") or 0) > max_bytes:
                response["Body"].close()
                data = None
            else:  # with a bound, one byte past it at most (a chunked answer has no ContentLength)
                data = response["Body"].read() if max_bytes is None else response["Body"].read(max_bytes + 1)
        except self._errors() as e:
            self._fail("get", key, e)
            return None
        if data is None or (max_bytes is not None and len(data) > max_bytes):
            with self._lock:
                self._stats["oversized"] += 1
            return None
        self._hit(len(data))
        return data

    def head(self, key: ChunkKey, max_bytes: int) -> bytes | None:
        """The first ``min(max_bytes, size)`` bytes (one ranged GET), or None."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be positive")
        try:
            data = self._get(key, f"bytes=0-{max_bytes - 1}")["Body"].read()
        except self._errors() as e:
            self._fail("head", key, e)
            return None
        self._hit(len(data))
        return data

    def get_ranges(self, key: ChunkKey, ranges: Sequence[tuple[int, int]]) -> list[bytearray] | None:
        """Bytes of each ``(offset, length)`` (adjacent ranges in one ranged GET), or None.

        Raises:
            ValueError: a negative offset or length.
        """
        for off, length in ranges:
            if off < 0 or length < 0:
                raise ValueError(f"bad range ({off}, {length})")
        outs = [bytearray(length) for _off, length in ranges]
        return outs if self.get_ranges_into(key, ranges, outs) else None

    def get_ranges_into(self, key: ChunkKey, ranges: Sequence[tuple[int, int]],
                        outs: Sequence[Buffer]) -> bool:
        """Stream each run of adjacent ranges (one ranged GET) into the matching writable
        buffers. False on a miss, an error or a short body (counted).

        Raises:
            ValueError: bad ranges or a buffer of the wrong size.
        """
        views = [memoryview(o).cast("B") for o in outs]
        if len(views) != len(ranges):
            raise ValueError(f"{len(ranges)} ranges but {len(views)} buffers")
        for (off, length), v in zip(ranges, views, strict=False):
            if off < 0 or length < 0 or v.nbytes != length:
                raise ValueError(f"bad range ({off}, {length}) for a buffer of {v.nbytes} bytes")
        total = 0
        try:
            i = 0
            while i < len(ranges):
                j, end = i + 1, ranges[i][0] + ranges[i][1]
                while j < len(ranges) and ranges[j][0] == end:
                    end += ranges[j][1]
                    j += 1
                if end > ranges[i][0]:
                    body = self._get(key, f"bytes={ranges[i][0]}-{end - 1}")["Body"]
                    try:
                        for v in views[i:j]:
                            filled = 0
                            while filled < v.nbytes:
                                n = body.readinto(v[filled:])
                                if not n:
                                    raise OSError(f"short body for {key} (range past the end?)")
                                filled += n
                            total += filled
                    finally:
                        body.close()
                i = j
        except self._errors() as e:
            self._fail("get_ranges", key, e)
            return False
        self._hit(total)
        return True

    def _hit(self, nbytes: int) -> None:
        with self._lock:
            self._stats["hits"] += 1
            self._stats["bytes_read"] += nbytes

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        present = [k for k, ok in zip(keys, self.contains(keys), strict=False) if ok]
        n = 0
        for start in range(0, len(present), 1000):
            batch = present[start:start + 1000]
            try:
                self._client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self._okey(k)} for k in batch], "Quiet": True})
                n += len(batch)
            except self._errors() as e:
                self._fail("delete", f"{len(batch)} keys", e)
        return n

    def clear(self, namespace: str | None = None, *, batch: int = 1000, stale: bool = False) -> Cleared:
        """Delete the chunk objects of ours (of ``namespace`` when given) under this tier's
        prefix; returns how many were deleted, with what was kept
        (:class:`~tiers.ownership.Cleared`). Lists ``<prefix>[<namespace>/]`` with paginated
        ``ListObjectsV2``; of the keys whose rest parses as a :class:`~tiers.keys.ChunkKey`,
        each object's first bytes are read (a ranged GET each, on the tier's thread pool) and
        only chunk objects of this or an older format version (``stale``: only older ones) are
        removed with ``DeleteObjects``, ``batch`` (at most 1000) keys a request: a newer-format
        object or a foreign one stays (:func:`tiers.ownership.classify`), as does every other
        object of the bucket.

        Raises:
            ValueError: ``namespace`` is not a valid key part, or ``batch`` not in 1..1000.
            OSError: listing, reading or deleting failed (the message says how many were
                deleted).
        """
        if namespace is not None:
            ChunkKey(namespace, "seg", "x")  # raises ValueError on a malformed namespace
        if not 1 <= batch <= 1000:
            raise ValueError(f"batch={batch} must be in 1..1000 (the DeleteObjects limit)")
        list_prefix = self.prefix + (f"{namespace}/" if namespace is not None else "")
        deleted, failed = 0, 0
        skipped: dict[str, int] = {}
        pending: list[str] = []

        def flush() -> None:
            nonlocal deleted, failed
            n = check_bytes(stale)
            heads = list(self._pool.map(lambda k: self._prefix_of(k, n), pending))
            kinds = [None if h is None else classify(h) for h in heads]  # None: gone meanwhile
            doomed = []
            for k, kind in zip(pending, kinds, strict=True):
                if deletable(kind, stale):
                    doomed.append(k)
                elif kind is not None:
                    skipped[kind] = skipped.get(kind, 0) + 1
            pending.clear()
            if not doomed:
                return
            got = self._client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in doomed], "Quiet": True})
            errors = got.get("Errors") or []
            for err in errors[:3]:
                log.warning("s3 tier clear: %s not deleted: %s", err.get("Key"), err.get("Code"))
            failed += len(errors)
            deleted += len(doomed) - len(errors)

        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=list_prefix, PaginationConfig={"PageSize": batch})
            for page in pages:
                for obj in page.get("Contents") or []:
                    if self._is_chunk_key(obj["Key"], namespace):
                        pending.append(obj["Key"])
                    if len(pending) >= batch:
                        flush()
            if pending:
                flush()
        except self._errors() as e:
            self._fail("clear", list_prefix, e)
            raise OSError(f"s3 clear failed after deleting {deleted} chunk object(s): "
                          f"{self._code(e)}") from None
        if failed:
            self._count("errors", failed)
            raise OSError(f"s3 clear deleted {deleted} chunk object(s) but {failed} failed")
        return Cleared(deleted, skipped)

    def _prefix_of(self, object_key: str, nbytes: int = PREFIX_BYTES) -> bytes | None:
        """The first ``nbytes`` bytes of an object (b'' for an empty
        one: S3 answers a range of it with InvalidRange; None when it is gone). Raises the
        client's other errors."""
        try:
            return self._client.get_object(Bucket=self.bucket, Key=object_key,
                                           Range=f"bytes=0-{nbytes - 1}")["Body"].read()
        except self._botocore_exc.ClientError as e:
            code = self._code(e)
            if code in _MISSING:
                return None
            if code in ("InvalidRange", "416"):
                return b""
            raise

    def _is_chunk_key(self, object_key: str, namespace: str | None) -> bool:
        if not object_key.startswith(self.prefix):
            return False
        try:
            key = ChunkKey.parse(object_key[len(self.prefix):])
        except ValueError:
            return False
        return namespace is None or key.namespace == namespace

    def stats(self) -> dict[str, float]:
        with self._lock:
            # the bucket owns capacity and usage (lifecycle rules); not tracked here
            return {**self._stats, "evictions": 0, "bytes_used": 0, "capacity_bytes": 0, "num_chunks": 0}

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class _Body:
    """A GetObject body whose read errors are ``OSError`` (counted by the tier); ``length``:
    the object's ContentLength in bytes (None when the answer had none)."""

    def __init__(self, tier: S3Tier, body, length: int | None = None) -> None:
        self._tier, self._body, self.length = tier, body, length

    def readinto(self, buf) -> int:
        try:
            n = self._body.readinto(buf)
        except self._tier._stream_errors as e:
            self._tier._fail("read", "stream", e)
            raise OSError(f"s3 read failed: {type(e).__name__}") from None
        with self._tier._lock:
            self._tier._stats["bytes_read"] += n
        return n

    def close(self) -> None:
        try:
            self._body.close()
        except self._tier._stream_errors:
            pass

