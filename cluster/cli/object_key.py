"""The object key ``kvblend server`` makes sure of (issue 37), as :mod:`cluster.cli.ray_auth`
does the Ray token.

A keyless process accepts unsigned chunk objects, so anyone who can write the disk directory,
Redis or the S3 prefix could plant a chunk that changes every later answer using it
(:mod:`tiers.auth`). So :func:`prepare` finds the key the way every kvblend process does
(:func:`cluster.env.configure_object_auth`: ``$KVBLEND_OBJECT_KEY_FILE``, ``$KVBLEND_OBJECT_KEY``,
``~/.kvblend/object_key``) and, when there is none, creates the file (mode 0600, 32 random bytes
as URL-safe text; ``$KVBLEND_OBJECT_KEY_FILE`` moves it), says where it is (never what) and
turns authentication on in this process. The processes of this machine (the shards under the
Ray it starts, vLLM's connectors, ``kvblend ingest``) find the file there; another node needs
the same file in the same place (or named by ``$KVBLEND_OBJECT_KEY_FILE``) before its Ray node
and vLLM start.

The cluster then knows it has a key: :func:`shard_env` tells the shards ``kvblend server``
creates (``KVBLEND_OBJECT_AUTH=required``: a shard that finds no key refuses to start, naming
where it looked), and :func:`mark_cluster` tells every later Ray driver
(:func:`cluster.cache.connect.connect` refuses a keyless one). ``--no-object-auth`` creates
nothing, runs this server and its shards keyless and says loudly what that gives up.

Rotating the key (README, "Object authentication"): every object signed under the old key
becomes a counted miss (``read_errors``) and is recomputed and stored again under the new one;
``kvblend clear --stale`` reclaims the old objects.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys

from cluster import env as envmod

log = logging.getLogger("kvblend.server")


def _create(path: str) -> None:
    """Write a fresh key to ``path`` (mode 0600; its folder made 0700 when missing).

    Raises:
        ValueError: the file cannot be created (the message names the path, never a key).
    """
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ValueError(f"object key file {path}: cannot create it: {e.strerror or e}") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_urlsafe(32) + "\n")


def prepare(*, no_object_auth: bool) -> str | None:
    """Make sure this process has an object key (see the module docstring); returns where it is
    (a path, or ``$KVBLEND_OBJECT_KEY``), None with ``--no-object-auth``. Sets
    ``KVBLEND_OBJECT_AUTH=off`` in this process's environment in that case (a head started here
    and its shards inherit it).

    Raises:
        ValueError: the key cannot be created or read, or is too short (never shown).
    """
    if no_object_auth or os.environ.get(envmod.OBJECT_AUTH) == "off":
        os.environ[envmod.OBJECT_AUTH] = "off"
        envmod.configure_object_auth(dict(os.environ))
        log.warning("kvblend: --no-object-auth: chunk objects are neither signed nor checked: anyone who can "
                    "write the disk tier, the Redis or the S3 prefix can plant a chunk that changes the answer "
                    "of every later request that reuses it")
        return None
    environ = dict(os.environ)
    where, created = envmod.object_key_file(environ), False
    if environ.get(envmod.OBJECT_KEY) and not environ.get(envmod.OBJECT_KEY_FILE):
        where = "$" + envmod.OBJECT_KEY
    elif not os.path.isfile(where):
        _create(where)
        created = True
    envmod.configure_object_auth(environ)
    print(f"kvblend: object authentication is on: chunk objects are signed and checked with the key in "
          f"{where}{' (created now, mode 0600)' if created else ''}. Processes of this machine find it there; "
          f"another node needs the same key in {envmod.object_key_file({})} (or named by "
          f"{envmod.OBJECT_KEY_FILE}) before its Ray node and vLLM start", file=sys.stderr)
    return where


def shard_env(where: str | None) -> dict[str, str]:
    """What the shards ``kvblend server`` creates are told: a key is required (``where`` set) or
    object authentication is off."""
    return {envmod.OBJECT_AUTH: "required" if where is not None else "off"}


def mark_cluster(namespace: str, where: str | None) -> None:
    """Record in the cluster (Ray's internal key-value store, under ``namespace``) whether its
    chunk objects are signed, for :func:`cluster.cache.connect.connect` of later drivers."""
    from ray.experimental import internal_kv

    from cluster.cache.connect import OBJECT_AUTH_MARK

    internal_kv._internal_kv_put(OBJECT_AUTH_MARK, b"required" if where is not None else b"off",
                                 namespace=namespace)
