"""The one place that reads environment variables (at start-up, never in tiers/ or blend/).

Registry:
  KVBLEND_CONFIG           YAML config file
  KVBLEND_CACHE_DIR        same as KVBLEND_CACHE_DIR field ``cache_dir``
  KVBLEND_<FIELD>          any config field by its upper-cased name, e.g. KVBLEND_RECOMPUTE_RATIOS
  KVBLEND_NODE_NAME        a shard node's stable identity, naming its disk directories
                           (read by the shard actor at start-up: cluster.cache.identity)
  KVBLEND_OBJECT_KEY       the secret that signs and checks chunk objects (tiers.auth); or
  KVBLEND_OBJECT_KEY_FILE  a file holding it (wins); never a config field, never logged. Neither
                           set: the file ~/.kvblend/object_key when it exists (``kvblend server``
                           creates it, cluster.cli.object_key)
  KVBLEND_OBJECT_AUTH      set by ``kvblend server`` for its shards: ``required`` (no key found
                           stops start-up) or ``off`` (``--no-object-auth``: no key even if found)
  LMCACHE_CONFIG_FILE      an LMCache YAML file (read through cluster.config.LMCACHE_KEYS)
  LMCACHE_<KEY>            LMCache's variables (LMCACHE_ENABLE_BLENDING, ...), same table
  RAY_ADDRESS              read by Ray itself when ray_address is 'auto'
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator

PREFIX = "KVBLEND_"
LMCACHE_PREFIX = "LMCACHE_"
_NOT_FIELDS = {"KVBLEND_CONFIG", "LMCACHE_CONFIG_FILE", "LMCACHE_LOG_LEVEL"}


def snapshot() -> dict[str, str]:
    """A copy of the process environment, taken once by the caller at start-up."""
    return dict(os.environ)


def config_values(environ: dict[str, str], fields: Collection[str]) -> Iterator[tuple[str, str, str]]:
    """Yield (name, raw value, variable) for every kvblend/LMCache config variable.

    ``name`` is our field name for ``KVBLEND_*`` (unknown ones raise) and LMCache's key for
    ``LMCACHE_*`` (mapped by :mod:`cluster.config`). ``fields`` are the config's field names
    (:data:`cluster.config.FIELD_SECTION`, passed in so this module imports no config).

    Raises:
        ValueError: a ``KVBLEND_*`` variable that names no config field.
    """
    for var in sorted(environ):
        if var in _NOT_FIELDS:
            continue
        if var.startswith(PREFIX):
            name = var[len(PREFIX):].lower()
            if name not in fields:
                if name in _INTERNAL:
                    continue
                raise ValueError(f"unknown environment variable {var}: no config field {name!r}; known: "
                                 + ", ".join(PREFIX + n.upper() for n in sorted(fields)))
            yield name, environ[var], var
        elif var.startswith(LMCACHE_PREFIX):
            yield var[len(LMCACHE_PREFIX):].lower(), environ[var], var


# KVBLEND_* variables that are not config fields (test and tooling switches, the node name,
# the object key).
_INTERNAL = {"log_level", "test_keep", "connector_debug", "node_name", "object_key", "object_key_file",
             "object_auth"}

OBJECT_KEY = "KVBLEND_OBJECT_KEY"
OBJECT_KEY_FILE = "KVBLEND_OBJECT_KEY_FILE"
OBJECT_AUTH = "KVBLEND_OBJECT_AUTH"


def object_key_file(environ: dict[str, str]) -> str:
    """Where this process looks for the object key file: ``$KVBLEND_OBJECT_KEY_FILE``, else
    ``~/.kvblend/object_key`` (``HOME`` of ``environ``, else this process's), the place
    ``kvblend server`` creates it, as Ray keeps its token in ``~/.ray/auth_token``."""
    home = environ.get("HOME") or os.path.expanduser("~")
    return environ.get(OBJECT_KEY_FILE) or os.path.join(home, ".kvblend", "object_key")


def missing_key_message(environ: dict[str, str], why: str) -> str:
    """The refusal of a process without a key where one is required: ``why``, then where the
    key is expected (never a key itself)."""
    return (f"no object key: {why}; this process expects it in {object_key_file(environ)} (copy the "
            f"file from the machine that ran `kvblend server`, or name it with {OBJECT_KEY_FILE}; "
            f"{OBJECT_KEY} works too); `kvblend server --no-object-auth` turns object authentication off")


def configure_object_auth(environ: dict[str, str]) -> bool:
    """Sign and check chunk objects in this process with the key ``environ`` names
    (:mod:`tiers.auth`): the file ``$KVBLEND_OBJECT_KEY_FILE``, else ``$KVBLEND_OBJECT_KEY``,
    else ``~/.kvblend/object_key`` when it exists; neither signs nor checks when none is found or
    ``$KVBLEND_OBJECT_AUTH`` is ``off``. True when a key is set. Called at start-up by
    ``load_config`` (of this process's environment), a shard's constructor and the node agent.

    Raises:
        ValueError: an unreadable key file, a key under 16 bytes (the key is not shown), or no
            key while ``$KVBLEND_OBJECT_AUTH`` is ``required`` (the message says where the key
            is expected).
    """
    from tiers import auth

    mode = environ.get(OBJECT_AUTH, "")
    if mode == "off":
        auth.configure(None)
        return False
    path, value = environ.get(OBJECT_KEY_FILE, ""), environ.get(OBJECT_KEY, "")
    if not path and not value and os.path.isfile(object_key_file(environ)):
        path = object_key_file(environ)
    authenticator = auth.load_key(path, value)
    if authenticator is None and mode == "required":
        raise ValueError(missing_key_message(environ, "this cluster signs its chunk objects"))
    auth.configure(authenticator)
    return authenticator is not None

NODE_NAME = "KVBLEND_NODE_NAME"


def node_name_override(environ: dict[str, str]) -> str | None:
    """``$KVBLEND_NODE_NAME`` when set and not blank, else None (then the host name is used)."""
    value = environ.get(NODE_NAME, "").strip()
    return value or None
