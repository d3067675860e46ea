"""The Redis tier: one self-describing value per chunk object in a Redis server.

* Value = the whole encoded chunk object (:mod:`tiers.format`), under the key
  ``<key_prefix><namespace>/<kind>/<content>``; no separate metadata keys to orphan.
* ``put`` is ``SET key value NX [EX ttl]``: atomic and first-wins (Redis applies a SET
  whole, so readers never see a torn value); an optional TTL bounds how long a chunk lives.
* Layer reads are ``GETRANGE`` (one pipelined round trip for all ranges of a call); the
  header probe is one ``GETRANGE 0 HEADER_PROBE_BYTES-1`` (Redis clamps it to the value).
* ``contains`` pipelines ``EXISTS`` per key: one round trip for the batch.
* :meth:`RedisTier.clear` (``kvblend clear --shared``) deletes the chunk objects of one
  namespace, or all, under ``key_prefix``: ``SCAN`` with a ``MATCH`` on the prefix, only keys
  that parse as chunk keys and whose values read as our chunk objects (:mod:`tiers.ownership`),
  ``UNLINK`` in batches; never ``FLUSHDB``.
* redis-py with hiredis (when installed) and a connection pool; db and a percent-encoded
  password come from the URL (``redis://:password@host:port/db``), or the password whole from
  ``password`` (:mod:`tiers.redis_url`: no message shows a part of one). ``rediss://`` is TLS: the server's certificate
  and host name are verified (``ssl_cert_reqs='required'``) against ``tls_ca_file`` (the
  system's trust store when empty); ``tls_cert_file``/``tls_key_file`` are the client's
  certificate for a server with ``tls-auth-clients yes``. The files are read by OpenSSL when a
  connection opens; their contents are never logged.
* A value larger than the server's ``proto-max-bulk-len`` (read once with ``CONFIG GET``;
  512 MiB by default) is refused before sending: logged with both sizes, counted in
  ``stats()['too_large']`` and ``put`` returns False. A whole-object read never takes more
  than ``max_object_bytes`` (that same limit by default) or the bound its caller gives
  (:func:`tiers.reader.read_object`: the object its header describes): ``STRLEN`` first, a
  longer value is a miss counted in ``stats()['oversized']``.

Failure behaviour: every command runs with ``socket_timeout=timeout_s`` (connect too). A
timeout, a refused connection, a failed TLS handshake (unknown CA, a client certificate the
server refuses), a dead or restarting server or any other ``RedisError`` / ``OSError`` is a
miss (``None``/``False``) counted in ``stats()['errors']``; nothing raises to the caller
except caller mistakes (``ValueError``) and the administrative :meth:`clear`, which raises
``OSError`` so that ``kvblend clear`` can report a failed clear. The pool reconnects by itself
once the server is back.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Sequence

from tiers.config import check_tls_pairing
from tiers.keys import ChunkKey
from tiers.ownership import Cleared, check_bytes, classify, deletable
from tiers.redact import redact_text, redact_url
from tiers.redis_url import connect_options, read_password_file
from tiers.tier import Buffer

log = logging.getLogger(__name__)

_COUNTERS = ("hits", "misses", "errors", "puts", "too_large", "oversized", "bytes_read", "bytes_written")
_DEFAULT_MAX_BULK = 512 * 1024 * 1024
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


class RedisTier:
    """Chunk objects in Redis (see module docstring).

    Args:
        url: ``redis://[:password@]host:port/db`` or ``rediss://...`` (TLS).
        ttl_s: seconds a stored chunk lives (0 = no expiry).
        timeout_s: socket connect and command timeout in seconds.
        key_prefix: prepended to every Redis key (to share one server between deployments).
        max_connections: size of the connection pool.
        name: tier name in stats.
        tls_ca_file: PEM CA certificate(s) the server's certificate must chain to
            (``rediss://`` only; '' = the system's trust store).
        tls_cert_file: PEM client certificate (``rediss://`` only; '' = none), for a server
            with ``tls-auth-clients yes``.
        tls_key_file: PEM private key of ``tls_cert_file`` ('' = none or inside it).
        max_object_bytes: the most bytes a whole-object :meth:`get` reads (0 = the server's
            ``proto-max-bulk-len``); a longer value is a miss counted in ``oversized``.
        password: the password whole (any characters), when the URL carries none.

    Raises:
        ValueError: a malformed URL (a password in it not percent-encoded, or also given as
            ``password``), negative ttl or max_object_bytes or non-positive timeout; a TLS file with a
            URL that is not ``rediss://``, a key without a certificate, or a TLS file that
            cannot be read (the message names the parameter and the path, never a file's
            contents or the URL's password).
    """

    def __init__(self, url: str, ttl_s: int = 0, timeout_s: float = 5.0, *,
                 key_prefix: str = "kvblend:", max_connections: int = 32,
                 name: str = "redis", tls_ca_file: str = "", tls_cert_file: str = "",
                 tls_key_file: str = "", max_object_bytes: int = 0, password: str = "") -> None:
        import redis  # heavy-ish; only deployments with a Redis tier pay for it

        if ttl_s < 0:
            raise ValueError(f"ttl_s={ttl_s} must be >= 0")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.name = name
        self.ttl_s = int(ttl_s)
        self.key_prefix = key_prefix
        self._redis_mod = redis
        tls = _tls_kwargs(url, tls_ca_file, tls_cert_file, tls_key_file)
        auth = connect_options(url, password)  # a bad userinfo: refused before urllib quotes it
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                max_connections=max_connections, retry_on_timeout=False, **tls, **auth)
        except ValueError as e:  # the message may quote the URL: never its password
            raise ValueError(f"redis url {redact_url(url)!r} is malformed: {redact_text(str(e), url)}") from None
        if max_object_bytes < 0:
            raise ValueError(f"max_object_bytes={max_object_bytes} must be >= 0")
        #: the most bytes a whole-object read takes (0: the server's proto-max-bulk-len)
        self.max_object_bytes = int(max_object_bytes)
        self._max_bulk: int | None = None
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(_COUNTERS, 0)

    @classmethod
    def from_config(cls, cfg) -> RedisTier:
        """From a :class:`tiers.config.TiersConfig` (``redis_url``, ``redis_ttl_s``,
        ``io_timeout_s``, ``redis_tls_ca_file``, ``redis_tls_cert_file``, ``redis_tls_key_file``,
        ``max_object_mib``, ``redis_password`` or ``redis_password_file``, read here).

        Raises:
            ValueError: as the constructor; an unreadable password file, or both password fields.
        """
        if cfg.redis_password and cfg.redis_password_file:
            raise ValueError("redis_password and redis_password_file both give the Redis password: give one")
        password = read_password_file(cfg.redis_password_file) if cfg.redis_password_file else cfg.redis_password
        return cls(cfg.redis_url, cfg.redis_ttl_s, cfg.io_timeout_s,
                   tls_ca_file=cfg.redis_tls_ca_file, tls_cert_file=cfg.redis_tls_cert_file,
                   tls_key_file=cfg.redis_tls_key_file,
                   max_object_bytes=int(cfg.max_object_mib * 2**20), password=password)

    def _rkey(self, key: ChunkKey) -> str:
        return f"{self.key_prefix}{key}"

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _error(self, op: str, key: object, e: Exception) -> None:
        # Never log the URL (it may carry a password); the exception text does not.
        log.debug("redis tier %s %s failed: %s: %s", op, key, type(e).__name__, e)
        self._count("errors")

    def _errors(self) -> tuple[type[BaseException], ...]:
        return (self._redis_mod.RedisError, OSError)

    def max_value_bytes(self) -> int:
        """The server's ``proto-max-bulk-len`` (cached; the default when CONFIG is disabled).

        Raises:
            redis.RedisError/OSError: the server is unreachable (callers catch it).
        """
        if self._max_bulk is None:
            try:
                got = self._client.config_get("proto-max-bulk-len")
                self._max_bulk = int(got.get("proto-max-bulk-len", _DEFAULT_MAX_BULK))
            except self._redis_mod.ResponseError:  # CONFIG renamed/disabled (managed Redis)
                self._max_bulk = _DEFAULT_MAX_BULK
        return self._max_bulk

    # -- Tier ----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._rkey(k))
            return [bool(n) for n in pipe.execute()]
        except self._errors() as e:
            self._error("contains", f"{len(keys)} keys", e)
            return [False] * len(keys)

    def put(self, key: ChunkKey, obj: Buffer) -> bool:
        """``SET NX`` (first wins; True also when the key was already there). False on an
        error or when the object exceeds ``proto-max-bulk-len`` (both counted)."""
        view = memoryview(obj).cast("B")
        try:
            limit = self.max_value_bytes()
            if view.nbytes > limit:
                log.error("redis tier: chunk %s is %d bytes, over the server's proto-max-bulk-len "
                          "of %d bytes; not stored (raise proto-max-bulk-len or use smaller chunks)",
                          key, view.nbytes, limit)
                self._count("too_large")
                return False
            self._client.set(self._rkey(key), view, nx=True, ex=self.ttl_s or None)
        except self._errors() as e:
            self._error("put", key, e)
            return False
        with self._lock:
            self._stats["puts"] += 1
            self._stats["bytes_written"] += view.nbytes
        return True

    def get(self, key: ChunkKey, max_bytes: int | None = None) -> bytes | None:
        """The whole value, or None (missing, an error). Every read is bounded: a value longer
        than ``max_bytes`` (when given) or than :attr:`max_object_bytes` (0: the server's
        ``proto-max-bulk-len``, the largest value a put could have stored) is a miss counted in
        ``oversized``, found before it is read: ``STRLEN`` and a ``GETRANGE`` of at most the
        bound in one pipelined round trip, so nothing larger is ever allocated.

        Raises:
            ValueError: ``max_bytes`` is not positive.
        """
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be positive")
        try:
            cap = self.max_object_bytes or self.max_value_bytes()
            max_bytes = cap if max_bytes is None else min(max_bytes, cap)
            pipe = self._client.pipeline(transaction=False)
            pipe.strlen(self._rkey(key))
            pipe.getrange(self._rkey(key), 0, max_bytes - 1)
            size, data = pipe.execute()
        except self._errors() as e:
            self._error("get", key, e)
            return None
        if size > max_bytes or len(data) != size:  # over the bound, or changed in between
            self._count("oversized" if size > max_bytes else "errors")
            return None
        self._record(data or None)  # STRLEN/GETRANGE of a missing key: 0, b""
        return data or None

    def head(self, key: ChunkKey, max_bytes: int) -> bytes | None:
        """The first ``min(max_bytes, size)`` bytes (one GETRANGE), or None."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be positive")
        try:
            data = self._client.getrange(self._rkey(key), 0, max_bytes - 1)
        except self._errors() as e:
            self._error("head", key, e)
            return None
        self._record(data or None)  # GETRANGE of a missing key is b""
        return data or None

    def get_ranges(self, key: ChunkKey, ranges: Sequence[tuple[int, int]]) -> list[memoryview] | None:
        """Bytes of each ``(offset, length)``: one GETRANGE per run of adjacent ranges (a
        whole chunk's layers are one run), all in one pipelined round trip, returned as
        zero-copy slices. None on a miss or error, or when a range runs past the end of the
        value (counted in ``errors``).

        Raises:
            ValueError: a negative offset or length.
        """
        for off, length in ranges:
            if off < 0 or length < 0:
                raise ValueError(f"bad range ({off}, {length})")
        runs = _runs(ranges)
        try:
            pipe = self._client.pipeline(transaction=False)
            for start, end, _i, _j in runs:
                pipe.getrange(self._rkey(key), start, end - 1)
            got = pipe.execute() if runs else []
        except self._errors() as e:
            self._error("get_ranges", key, e)
            return None
        out: list[memoryview] = []
        for (start, end, i, j), data in zip(runs, got, strict=False):
            if len(data) != end - start:
                if len(data) == 0:
                    self._record(None)  # absent (or expired meanwhile)
                else:
                    self._count("errors")  # range past the end
                return None
            view = memoryview(data)
            out.extend(view[off - start:off - start + length] for off, length in ranges[i:j])
        with self._lock:
            self._stats["hits"] += 1
            self._stats["bytes_read"] += sum(len(d) for d in got)
        return out

    def _record(self, data: bytes | None) -> None:
        with self._lock:
            if data is None:
                self._stats["misses"] += 1
            else:
                self._stats["hits"] += 1
                self._stats["bytes_read"] += len(data)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        try:
            return int(self._client.delete(*[self._rkey(k) for k in keys]))
        except self._errors() as e:
            self._error("delete", f"{len(keys)} keys", e)
            return 0

    def clear(self, namespace: str | None = None, *, batch: int = 500, stale: bool = False) -> Cleared:
        """Delete the chunk objects of ours (of ``namespace`` when given) under ``key_prefix``;
        returns how many were deleted, with what was kept (:class:`~tiers.ownership.Cleared`).
        ``SCAN`` with ``MATCH <prefix>[<namespace>/]*``; of the keys whose rest parses as a
        :class:`~tiers.keys.ChunkKey`, each value's first bytes are read (one pipelined
        ``GETRANGE`` per ``batch`` keys) and only chunk objects of this or an older format
        version (``stale``: only older ones) are removed (``UNLINK``, ``DEL`` where the server
        lacks it): a newer-format object or a foreign value stays, whatever its key
        (:func:`tiers.ownership.classify`). Never ``FLUSHDB``.

        Raises:
            ValueError: ``namespace`` is not a valid key part, or ``batch`` < 1.
            OSError: the server failed or is unreachable (the message says how many were
                deleted before).
        """
        pattern = _glob_escape(self.key_prefix) + _namespace_part(namespace) + "*"
        if batch < 1:
            raise ValueError(f"batch={batch} must be >= 1")
        deleted = 0
        skipped: dict[str, int] = {}
        pending: list[bytes] = []
        try:
            for raw in self._client.scan_iter(match=pattern, count=max(batch, 100)):
                if self._is_chunk_key(raw, namespace):
                    pending.append(raw)
                if len(pending) >= batch:
                    deleted += self._clear_batch(pending, stale, skipped)
                    pending = []
            if pending:
                deleted += self._clear_batch(pending, stale, skipped)
        except self._errors() as e:
            self._error("clear", namespace or "all", e)
            raise OSError(f"redis clear failed after deleting {deleted} chunk object(s): "
                          f"{type(e).__name__}: {e}") from None
        return Cleared(deleted, skipped)

    def _clear_batch(self, names: list[bytes], stale: bool, skipped: dict[str, int]) -> int:
        """Read each value's prefix (one pipelined round trip), unlink the deletable ones."""
        pipe = self._client.pipeline(transaction=False)
        n = check_bytes(stale)
        for name in names:
            pipe.getrange(name, 0, n - 1)
        doomed = []
        # raise_on_error=False: a value of another type (a hash, a list) answers WRONGTYPE
        for name, head in zip(names, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(head, self._redis_mod.ConnectionError | self._redis_mod.TimeoutError):
                raise head
            kind = classify(head if isinstance(head, bytes) else None)
            if deletable(kind, stale):
                doomed.append(name)
            elif head != b"":  # b"": gone meanwhile
                skipped[kind] = skipped.get(kind, 0) + 1
        return self._unlink(doomed) if doomed else 0

    def _is_chunk_key(self, raw: bytes | str, namespace: str | None) -> bool:
        try:
            text = raw.decode() if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            return False
        if not text.startswith(self.key_prefix):
            return False
        try:
            key = ChunkKey.parse(text[len(self.key_prefix):])
        except ValueError:
            return False
        return namespace is None or key.namespace == namespace

    def _unlink(self, names: list[bytes]) -> int:
        try:
            return int(self._client.unlink(*names))
        except self._redis_mod.ResponseError:  # UNLINK renamed/disabled: plain DEL
            return int(self._client.delete(*names))

    def stats(self) -> dict[str, float]:
        with self._lock:
            # the server owns capacity and usage (maxmemory, TTL); not tracked here
            return {**self._stats, "evictions": 0, "bytes_used": 0, "capacity_bytes": 0, "num_chunks": 0}

    def close(self) -> None:
        """Release the pooled connections."""
        self._client.close()


def _tls_kwargs(url: str, ca_file: str, cert_file: str, key_file: str) -> dict:
    """redis-py's ``ssl_*`` connection arguments for a ``rediss://`` URL ({} for ``redis://``).

    Raises:
        ValueError: a TLS file with a non-``rediss://`` URL, a key without a certificate, or a
            file that is not a readable file (named by parameter and path; never read here).
    """
    check_tls_pairing(url, ca_file, cert_file, key_file)
    if not url.lower().startswith("rediss://"):
        return {}
    files = {"tls_ca_file": ca_file, "tls_cert_file": cert_file, "tls_key_file": key_file}
    for param, path in files.items():
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ValueError(f"{param}={path!r} is not a readable file")
    return {"ssl_cert_reqs": "required", "ssl_ca_certs": ca_file or None,
            "ssl_certfile": cert_file or None, "ssl_keyfile": key_file or None}


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis ``MATCH`` pattern."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def _namespace_part(namespace: str | None) -> str:
    """``'<namespace>/'`` (validated as a key part) or '' for all namespaces."""
    if namespace is None:
        return ""
    ChunkKey(namespace, "seg", "x")  # raises ValueError on a malformed namespace
    return namespace + "/"


def _runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """Runs of adjacent non-empty ranges: ``(start, end, first_idx, end_idx)``."""
    runs: list[tuple[int, int, int, int]] = []
    for idx, (off, length) in enumerate(ranges):
        if runs and runs[-1][1] == off and length > 0:
            start, _end, i, _j = runs[-1]
            runs[-1] = (start, off + length, i, idx + 1)
        else:
            runs.append((off, off + length, idx, idx + 1))
    return runs
