"""The effective kvblend configuration: one frozen dataclass per package, composed here.

Precedence (lowest first), each value remembering where it came from::

    defaults  <  YAML file  <  environment (KVBLEND_*, LMCACHE_*)  <  CLI flags / vLLM extra config

The YAML file is ``--config``, else ``$KVBLEND_CONFIG``, else ``$LMCACHE_CONFIG_FILE``. Its keys
are our field names (a flat mapping) or LMCache's keys, read through :data:`LMCACHE_KEYS`.
Environment variables are read only in :mod:`cluster.env`, at start-up.

Unlike LMCache (which ignores environment variables when a config file is set), our
environment variables override the file. Unknown keys and malformed values stop start-up
with a ``ValueError`` naming the key, the value and what is allowed; a value is never
rewritten silently; LMCache settings that mean nothing here warn once.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from blend.config import LMCACHE_SELECTION, BlendConfig
from cluster import env as envmod
from tiers.config import TiersConfig, _f, check_fields

log = logging.getLogger("kvblend.config")


@dataclass(frozen=True)
class ClusterConfig:
    model: str = _f(
        "smollm2", "model served: 'smollm2' (the bundled SmolLM2-135M-Instruct), a path to a HF model folder, or a Hugging Face id found in the local HF cache")
    cache_dir: str = _f(
        "", "directory for the prepared model and the default disk tier ('' = ~/.cache/kvblend)")
    ray_address: str = _f(
        "auto", "Ray cluster to join: 'auto' (a running local cluster or $RAY_ADDRESS), 'local' (start one in-process), or host:port")
    ray_namespace: str = _f("kvblend", "Ray namespace of the shard actors")
    head_port: int = _f(
        6390, "GCS port of a Ray head that `kvblend server` starts (`--port`): fixed, so a restarted head keeps its address and connectors pinned to host:port find it again (not 6379: kvblend's Redis tier may listen there)", (1, 65535))
    shard_resource: str = _f(
        "kvblend_shard", "custom Ray resource a node advertises to host cache shards ('' = every node)")
    shards_per_node: int = _f(1, "shard actors per cache node", (1, 64))
    object_store_gib: float = _f(
        2.0, "GiB of Ray object store when kvblend starts the Ray node itself", (0.1, 4096.0))
    engine_type: str = _f(
        "blend", "what connectors do by default: 'blend' (CacheBlend on separator prompts) or 'prefix' (prefix reuse only)",
        choices=("blend", "prefix"))
    call_timeout_s: float = _f(
        2.0, "seconds a client waits for a shard call before counting a miss; at most load_timeout_s", (0.01, 3600.0))
    store_kv: bool = _f(True, "store the KV of segments not yet cached after a request")
    ray_client: str = _f(
        "agent", "how a vLLM connector reaches Ray: 'agent' (a child process is the Ray driver: vLLM outlives a lost Ray head) or 'driver' (in vLLM's process: one copy less, but Ray ends the process when the head is gone)",
        choices=("agent", "driver"))
    agent_arena_gib: float = _f(
        4.0, "GiB of shared memory each vLLM process gives its cache agent: a request's chunk objects cross there with one copy, and it keeps them for the next requests (a request's objects beyond it are misses: size it for the largest prompt, ~128 KiB a token for an 8B bf16 model; 0 = over the socket)", (0.0, 1024.0))
    local_fallback: str = _f(
        "disk", "cache a process uses while no shard is reachable: 'disk' (machine-local, disk_size_gib under disk_path), 'memory' (1 GiB in this process) or 'off' (misses only)",
        choices=("disk", "memory", "off"))
    metrics: bool = _f(True, "export Prometheus metrics (Ray metrics in shards, vLLM /metrics in connectors)")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class KVBlendConfig:
    """All of kvblend's settings, one frozen object; ``sources`` says where each came from."""

    tiers: TiersConfig = field(default_factory=TiersConfig)
    blend: BlendConfig = field(default_factory=BlendConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sources: types.MappingProxyType = field(default_factory=lambda: types.MappingProxyType({}))

    def get(self, name: str) -> Any:
        section = FIELD_SECTION[name]
        return getattr(getattr(self, section), name)

    def as_flat_dict(self) -> dict[str, Any]:
        return {name: self.get(name) for name in FIELD_SECTION}


SECTIONS = {"tiers": TiersConfig, "blend": BlendConfig, "cluster": ClusterConfig}
FIELD_SECTION: dict[str, str] = {}
FIELDS: dict[str, dataclasses.Field] = {}
for _section, _cls in SECTIONS.items():
    for _f_ in fields(_cls):
        if _f_.name in FIELD_SECTION:
            raise RuntimeError(f"config field {_f_.name} defined twice")
        FIELD_SECTION[_f_.name] = _section
        FIELDS[_f_.name] = _f_

# LMCache setting -> (our field, converter) or None when accepted but meaningless here
# (the string says why). Environment names are LMCACHE_<KEY upper>.
_GIB = "LMCache sizes are GiB (x 1024**3): mapped 1:1"
LMCACHE_KEYS: dict[str, tuple[str, str] | str] = {
    "enable_blending": ("enable_blending", "same meaning"),
    "blend_special_str": ("blend_separator", "same meaning"),
    "use_layerwise": "kvblend is always layer-wise; the value is ignored",
    "blend_check_layers": ("check_layers", "same meaning (0-based layer indices)"),
    "blend_recompute_ratios": ("recompute_ratios", "same meaning"),
    "blend_thresholds": ("recompute_thresholds", "same meaning"),
    "blend_min_tokens": ("min_tokens", "same meaning"),
    "chunk_size": ("chunk_size", "same meaning"),
    "local_cpu": "the host tier always exists (size 0 turns it off); the value is ignored",
    "max_local_cpu_size": ("host_size_gib", _GIB),
    "local_disk": ("disk_path", "LMCache's 'file://' prefix is accepted"),
    "max_local_disk_size": ("disk_size_gib", _GIB),
    "remote_url": "use redis_url / s3_url; the value is ignored",
    "save_unfull_chunk": "kvblend stores a blend segment as one object whatever its length; ignored",
}


def _base_type(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def _resolved_type(name: str):
    cls = SECTIONS[FIELD_SECTION[name]]
    return typing.get_type_hints(cls)[name]


def parse_value(name: str, raw: Any, origin: str) -> Any:
    """Convert ``raw`` (a YAML value or an environment string) to the type of field ``name``.

    Raises:
        ValueError: naming the origin (variable or key), the value and the expected type.
    """
    tp = _base_type(_resolved_type(name))
    try:
        if typing.get_origin(tp) is tuple:
            item_tp = typing.get_args(tp)[0]
            if isinstance(raw, str):
                items = [s for s in raw.replace("[", "").replace("]", "").split(",") if s.strip()]
            elif isinstance(raw, (list, tuple)):
                items = list(raw)
            else:
                items = [raw]
            return tuple(_scalar(item_tp, x) for x in items)
        return _scalar(tp, raw)
    except (TypeError, ValueError) as e:
        allowed = FIELDS[name].metadata.get("choices") or FIELDS[name].metadata.get("range")
        hint = f"; allowed: {allowed}" if allowed else ""
        raise ValueError(
            f"{origin}={raw!r} is not a valid {_type_name(tp)} for {name}{hint}") from e


def _type_name(tp) -> str:
    if typing.get_origin(tp) is tuple:
        return f"comma-separated list of {typing.get_args(tp)[0].__name__}"
    return tp.__name__


def _scalar(tp, raw):
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)
    if tp is int:
        if isinstance(raw, bool):
            raise ValueError(raw)
        if isinstance(raw, float) and not raw.is_integer():
            raise ValueError(raw)
        return int(str(raw).strip()) if isinstance(raw, str) else int(raw)
    if tp is float:
        if isinstance(raw, bool):
            raise ValueError(raw)
        return float(str(raw).strip()) if isinstance(raw, str) else float(raw)
    if tp is str:
        if not isinstance(raw, (str, int, float)):
            raise ValueError(raw)
        return str(raw)
    raise TypeError(f"unsupported field type {tp}")


def _from_lmcache(key: str, raw: Any, origin: str) -> tuple[str, Any] | None:
    spec = LMCACHE_KEYS.get(key)
    if spec is None:
        log.warning("%s: LMCache setting not used by kvblend; ignored", origin)
        return None
    if isinstance(spec, str):
        log.warning("%s: accepted for LMCache compatibility: %s", origin, spec)
        return None
    name, _ = spec
    if name == "disk_path" and isinstance(raw, str) and raw.startswith("file://"):
        raw = raw[len("file://"):]
    return name, parse_value(name, raw, origin)


def load_config(
    yaml_path: str | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    overrides_origin: str = "cli",
) -> KVBlendConfig:
    """Build the effective configuration.

    Args:
        yaml_path: a YAML file (our keys or LMCache's); None = from the environment
            (``KVBLEND_CONFIG``, then ``LMCACHE_CONFIG_FILE``) or none.
        overrides: highest-precedence values by field name (CLI flags, vLLM
            ``kv_connector_extra_config``; LMCache key names accepted too).
        environ: the environment to read (default: :func:`cluster.env.snapshot`).
        overrides_origin: label for the overrides in ``sources``.

    Raises:
        ValueError: unknown key, malformed value or value out of range; the message names
            the key or variable, the value and what is allowed. Also (reading this process's
            environment, which also sets the object key: :func:`cluster.env.configure_object_auth`)
            an object key that is unreadable or too short.
    """
    if environ is None:
        environ = envmod.snapshot()
        envmod.configure_object_auth(environ)  # a bad object key stops start-up (ValueError)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in FIELD_SECTION}

    lmcache_fields: set[str] = set()  # fields set through an LMCache name
    path = yaml_path or environ.get("KVBLEND_CONFIG") or environ.get("LMCACHE_CONFIG_FILE")
    if path:
        for name, value in _read_yaml(path, lmcache_fields).items():
            values[name] = value
            sources[name] = f"file {path}"

    for name, value, origin in envmod.config_values(environ, FIELD_SECTION):
        if name in FIELD_SECTION:
            values[name] = parse_value(name, value, origin)
            sources[name] = f"env {origin}"
        else:
            mapped = _from_lmcache(name, value, origin)
            if mapped:
                values[mapped[0]] = mapped[1]
                sources[mapped[0]] = f"env {origin}"
                lmcache_fields.add(mapped[0])

    for key, value in (overrides or {}).items():
        origin = f"{overrides_origin} {key}"
        if key in FIELD_SECTION:
            values[key] = parse_value(key, value, origin)
            sources[key] = overrides_origin
        elif key in LMCACHE_KEYS:
            mapped = _from_lmcache(key, value, origin)
            if mapped:
                values[mapped[0]] = mapped[1]
                sources[mapped[0]] = overrides_origin
                lmcache_fields.add(mapped[0])
        else:
            raise ValueError(f"unknown config key {key!r} ({overrides_origin}); known keys: "
                             + ", ".join(sorted(FIELD_SECTION)))
    _lmcache_selection(values, sources, lmcache_fields)
    return build(values, sources)


def _lmcache_selection(values: dict[str, Any], sources: dict[str, str], lmcache_fields: set[str]) -> None:
    """A config that sets LMCache's blend variables (``LMCACHE_BLEND_*``, ``blend_*`` keys of
    an LMCache file or extra config) gets LMCache's selection, CacheBlend's K deviation,
    unless it names a ``selection`` itself: LMCache's variables keep meaning what they meant
    (issue 17)."""
    blend = sorted(n for n in lmcache_fields if FIELD_SECTION.get(n) == "blend")
    if "selection" not in values and blend:
        values["selection"] = LMCACHE_SELECTION
        sources["selection"] = f"LMCache blend settings ({', '.join(blend)})"


def build(values: dict[str, Any], sources: dict[str, str] | None = None) -> KVBlendConfig:
    """Compose the per-package dataclasses from flat, already-typed values."""
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in values.items():
        if name not in FIELD_SECTION:
            raise ValueError(f"unknown config key {name!r}")
        per_section[FIELD_SECTION[name]][name] = value
    parts = {}
    for section, cls in SECTIONS.items():
        try:
            parts[section] = cls(**per_section[section])
        except ValueError as e:
            name = str(e).split("=")[0]
            src = (sources or {}).get(name, "")
            raise ValueError(f"{e} (from {src})" if src else str(e)) from None
    srcs = dict(sources or {})
    for name in FIELD_SECTION:
        srcs.setdefault(name, "default")
    check_deadlines(parts["tiers"], parts["blend"], parts["cluster"], srcs)
    return KVBlendConfig(sources=types.MappingProxyType(srcs), **parts)


#: per-call timeout -> the stage deadline it serves (issue 20): a worker's read of a cached layer
#: calls shards (``call_timeout_s``: ``get_refs``, the objects' ``ray.get``) and, when an owner
#: is gone, Redis/S3 directly (``io_timeout_s``); the blend waits ``load_timeout_s`` for it.
STAGE_DEADLINES = {"call_timeout_s": "load_timeout_s", "io_timeout_s": "load_timeout_s"}


def check_deadlines(tiers: TiersConfig, blend: BlendConfig, cluster: ClusterConfig,
                    sources: dict[str, str] | None = None) -> None:
    """Every per-call timeout is at most the deadline of the stage it serves
    (:data:`STAGE_DEADLINES`): a longer one would keep a read going after the request gave
    up on it, holding one of the client's threads.

    Raises:
        ValueError: naming both settings, their values and where each came from.
    """
    values = {**vars(tiers), **vars(blend), **vars(cluster)}
    for call, stage in STAGE_DEADLINES.items():
        if values[call] > values[stage]:
            where = {n: (sources or {}).get(n, "default") for n in (call, stage)}
            raise ValueError(
                f"{call}={values[call]:g} (from {where[call]}) is longer than {stage}={values[stage]:g} "
                f"(from {where[stage]}), the deadline of the stage it serves: lower {call} or raise {stage}")


def _read_yaml(path: str, lmcache_fields: set[str] | None = None) -> dict[str, Any]:
    """The file's values by field name; fields named through LMCache keys go into
    ``lmcache_fields``."""
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as e:
        raise ValueError(f"config file {path!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of keys to values")
    out: dict[str, Any] = {}
    for key, raw in data.items():
        origin = f"{path}:{key}"
        if key in FIELD_SECTION:
            out[key] = parse_value(key, raw, origin)
        elif key in LMCACHE_KEYS or key.startswith(("blend_", "local_", "max_", "remote_", "enable_", "lmcache")):
            mapped = _from_lmcache(key, raw, origin)
            if mapped:
                out[mapped[0]] = mapped[1]
                if lmcache_fields is not None:
                    lmcache_fields.add(mapped[0])
        elif key in ("extra_config", "lookup_url", "distributed_url", "pre_caching_hash_algorithm"):
            log.warning("%s: LMCache setting not used by kvblend; ignored", origin)
        else:
            raise ValueError(f"unknown config key {key!r} in {path}; known keys: "
                             + ", ".join(sorted(FIELD_SECTION)))
    return out


def describe_fields() -> list[dict[str, Any]]:
    """One row per field (name, section, type, default, doc, allowed) for docs and `config show`."""
    rows = []
    for name, f in FIELDS.items():
        allowed = f.metadata.get("choices") or f.metadata.get("range") or ""
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append({"name": name, "section": FIELD_SECTION[name],
                     "type": _type_name(_base_type(_resolved_type(name))),
                     "default": default, "doc": f.metadata.get("doc", ""), "allowed": allowed})
    return rows


def cache_dir(config: KVBlendConfig) -> str:
    import os

    return config.cluster.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "kvblend")


def redacted(config: KVBlendConfig) -> dict[str, Any]:
    """The flat effective config with secrets masked: the password of every ``*_url`` value
    (``redis://:***@host:6379/0``, :mod:`tiers.redact`). What logs and ``kvblend config show``
    print; never pass its values on to the tiers."""
    from tiers.redact import redact_fields

    return redact_fields(config.as_flat_dict())


def log_config(config: KVBlendConfig) -> None:
    """Log the effective configuration once (at start-up) with secrets masked (:func:`redacted`):
    what every connector and ``kvblend server`` log."""
    shown = {k: v for k, v in redacted(config).items() if config.sources.get(k) != "default"}
    log.info("kvblend config (non-default): %s", shown or "all defaults")
