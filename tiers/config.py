"""Configuration of the data plane (chunking and the five tiers).

Every field carries ``metadata`` with ``doc`` (one line, with the unit) and, where it
applies, ``range``; :mod:`cluster.config` composes this dataclass with the others, reads
YAML/environment/CLI values into it and validates them.  This module only states the
fields and checks the values it is given (``ValueError`` naming the field).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _f(default, doc: str, range_: tuple | None = None, choices: tuple | None = None):
    meta = {"doc": doc}
    if range_ is not None:
        meta["range"] = range_
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class TiersConfig:
    chunk_size: int = _f(
        256, "tokens per prefix chunk (the hashing unit of prefix reuse); blend segments are one chunk whatever their length",
        (16, 65536))
    gpu_size_gib: float = _f(
        0.0, "GiB of device memory per vLLM worker for the gpu tier of hot chunks (0 = off; on the CPU backend it is host memory)",
        (0.0, 1024.0))
    host_size_gib: float = _f(
        4.0, "GiB of host memory per shard for the host tier", (0.0, 4096.0))
    pinned_size_gib: float = _f(
        8.0, "GiB of page-locked host memory per CUDA vLLM worker for hot chunks staged to its GPU (0 = off; unused on the CPU backend)",
        (0.0, 4096.0))
    disk_path: str = _f(
        "", "directory of the disk tier ('' = <cache_dir>/disk)")
    disk_size_gib: float = _f(
        20.0, "GiB of files per shard in the disk tier (0 = off)", (0.0, 1048576.0))
    redis_url: str = _f(
        "", "redis://[:password@]host:port/db or rediss:// for TLS ('' = no Redis tier); a password here is percent-encoded (or use redis_password_file)")
    redis_password: str = _f(
        "", "the Redis password whole, any characters, instead of one in redis_url: set it as $KVBLEND_REDIS_PASSWORD ('' = none; never shown)")
    redis_password_file: str = _f(
        "", "file holding the Redis password whole (its trailing newline dropped), e.g. a mounted Secret, instead of one in redis_url ('' = none)")
    redis_ttl_s: int = _f(
        0, "seconds a chunk lives in Redis (0 = no expiry)", (0, 10**9))
    redis_tls_ca_file: str = _f(
        "", "PEM file of the CA certificate(s) that signed the Redis server's certificate; rediss:// only ('' = the system's trust store)")
    redis_tls_cert_file: str = _f(
        "", "PEM client certificate for a Redis with tls-auth-clients yes; rediss:// only ('' = none; the key is redis_tls_key_file, or in this file)")
    redis_tls_key_file: str = _f(
        "", "PEM private key of redis_tls_cert_file; rediss:// only ('' = none or in redis_tls_cert_file)")
    s3_url: str = _f(
        "", "s3://bucket[/prefix] of the S3 tier ('' = no S3 tier)")
    s3_endpoint_url: str = _f(
        "", "endpoint of an S3-compatible store ('' = AWS default)")
    s3_region: str = _f("", "S3 region ('' = from the standard AWS chain)")
    max_object_mib: float = _f(
        0.0, "MiB a chunk object read whole from Redis or S3 may have; a longer one is a miss counted in oversized, found before it is read (0 = no fixed cap: each read is bounded by the object its header describes, its layers of [2, tokens, KV heads, head dim] in its dtype, and Redis's by its proto-max-bulk-len)",
        (0.0, 1048576.0))
    compression: str = _f(
        "lz4", "compression of chunk layers below memory (disk, Redis, S3); a layer that does not shrink by 1.1x is stored raw",
        choices=("lz4", "none"))
    eviction_policy: str = _f(
        "lru", "eviction order of the host, disk and gpu tiers", choices=("lru", "lfu"))
    io_timeout_s: float = _f(
        2.0, "seconds before one tier read or write call counts as failed (a miss): Redis/S3 socket timeouts; a disk call running longer makes the disk refuse new calls until it returns; at most load_timeout_s", (0.01, 3600.0))
    lookup_timeout_s: float = _f(
        0.25, "seconds a shard lookup waits for the tiers below host memory (late keys are misses; clients wait this plus a margin)",
        (0.01, 3600.0))

    def __post_init__(self) -> None:
        check_fields(self)
        check_redis_tls(self)

    def __repr__(self) -> str:
        # URLs may carry a password (redis://:PASSWORD@...): masked in every repr (issue 19)
        from tiers.redact import redact_fields

        shown = redact_fields({f.name: getattr(self, f.name) for f in fields(self)})
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def check_fields(obj) -> None:
    """Check each field of a config dataclass against its ``range``/``choices`` metadata.

    Raises:
        ValueError: naming the field, the value and what is allowed.
    """
    for f in fields(obj):
        value = getattr(obj, f.name)
        rng = f.metadata.get("range")
        choices = f.metadata.get("choices")
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if rng is not None and not (rng[0] <= item <= rng[1]):
                raise ValueError(
                    f"{f.name}={value!r} is out of range: allowed {rng[0]}..{rng[1]}")
            if choices is not None and item not in choices:
                raise ValueError(
                    f"{f.name}={value!r} is not allowed: choose one of {', '.join(map(str, choices))}")


REDIS_TLS_FIELDS = ("redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file")


def check_redis_tls(cfg: TiersConfig) -> None:
    """The Redis TLS files go with a ``rediss://`` URL, and a client key with its certificate.

    With ``redis_url=''`` (no Redis tier) the files are unused and accepted. Only paths are
    checked here; whether the files can be read is the tier's business when it opens
    (:class:`tiers.redis_tier.RedisTier`).

    Raises:
        ValueError: as :func:`check_tls_pairing`, naming the ``redis_tls_*`` field.
    """
    if cfg.redis_url:
        check_tls_pairing(cfg.redis_url, cfg.redis_tls_ca_file, cfg.redis_tls_cert_file,
                          cfg.redis_tls_key_file, prefix="redis_")


def check_tls_pairing(url: str, ca_file: str, cert_file: str, key_file: str, prefix: str = "") -> None:
    """TLS files only with a ``rediss://`` URL, and a client key only with its certificate;
    the config (``prefix='redis_'``) and :class:`tiers.redis_tier.RedisTier` (``''``) both ask.

    Raises:
        ValueError: naming ``<prefix>tls_*_file`` and its path (never the URL's password).
    """
    files = {f"{prefix}tls_ca_file": ca_file, f"{prefix}tls_cert_file": cert_file,
             f"{prefix}tls_key_file": key_file}
    if not url.lower().startswith("rediss://"):
        for name, value in files.items():
            if value:
                raise ValueError(
                    f"{name}={value!r} needs a TLS Redis URL, but the Redis URL does not start "
                    f"with rediss://: use rediss://host:port/db or unset {name}")
    if key_file and not cert_file:
        raise ValueError(f"{prefix}tls_key_file={key_file!r} is set without {prefix}tls_cert_file: "
                         "a client key needs its certificate")
