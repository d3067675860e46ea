"""The cache's operations, declared once: a frozen request and answer type per op, the
:class:`Transport` protocol every medium implements, and the op table (:data:`OPS`) both ends
of the agent link dispatch from.

:class:`cluster.cache.client.CacheClient` is the one client; what differs by medium sits behind
:class:`Transport`: :class:`~cluster.cache.ray_transport.RayTransport` (the shard actors, from
this process), :class:`~cluster.cache.agent_transport.AgentTransport` (a cache agent process,
over a socket and a shared-memory arena) and :class:`~cluster.cache.local.LocalTransport` (a
tier in this process). The agent (:class:`cluster.cache.agent.Agent`) answers each op of the
table by handing its request to a ``RayTransport``.

Over the agent's socket (:mod:`cluster.cache.wire`) a request frame is ``{"id", "op", <the
request's fields>}`` plus its buffers, an answer ``{"id", "ok": true, "result"}`` (or
``"error"``) plus buffers; a request type's ``to_wire``/``from_wire`` and an op's ``answer``
reader convert. A malformed request is an error answer; a malformed answer is None (the
client counts it and serves a miss), never an exception.

=========  =======  ========  ===============================================  ====================
op         lane     buffers   request -> answer                                 transport method
=========  =======  ========  ===============================================  ====================
lookup     any      answer    :class:`LookupRequest` -> :class:`LookupAnswer`  ``lookup``
objects    any      answer    :class:`ObjectsRequest` -> :class:`SlotsAnswer`   ``objects``
contains   any      -         :class:`KeysRequest` -> ``[bool]`` per key        ``contains``
stats      any      -         :class:`StatsRequest` -> dict (JSON)              ``stats``
put        ordered  request   :class:`PutRequest` -> bool (stored)              ``put``
flush      ordered  -         :class:`FlushRequest` -> bool                     ``flush``
delete     ordered  -         :class:`KeysRequest` -> int                       ``delete``
clear      ordered  -         :class:`ClearRequest` -> int                      ``clear``
=========  =======  ========  ===============================================  ====================

``ordered`` ops are started one at a time in arrival order (a flush waits for the puts sent
before it); the others run side by side on the agent's worker threads, so a slow object read
never delays a lookup. ``buffers`` marks the ops whose frames carry large heap buffers, after
which the agent asks for a heap trim (:mod:`cluster.heap`). In this process ``objects``
answers :class:`ObjectsAnswer` (the objects themselves); over the link :class:`SlotsAnswer`
says what the agent wrote into the caller's arena slots (or sent as buffers without one).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

from tiers.keys import ChunkKey

if TYPE_CHECKING:
    import numpy as np

Keys = tuple[ChunkKey, ...]


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an int, got {value!r}")
    return value


def _seconds(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"expected seconds >= 0, got {value!r}")
    return float(value)


def _list(value, read) -> tuple:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {value!r}")
    return tuple(read(v) for v in value)


def _flag(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected a bool, got {value!r}")
    return value


def _slot(value) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2):
        raise ValueError(f"slot {value!r}")
    return _int(value[0]), _int(value[1])


def _namespace(value) -> str | None:
    if not (value is None or isinstance(value, str)):
        raise ValueError(f"namespace {value!r}")
    return value


#: parsed keys the agent keeps (a request's keys are mostly keys it read before: each parse
#: checks two parts against a pattern and builds a frozen dataclass, ~0.1 ms for 16 keys in
#: the agent's reader on a loaded 2-core machine, on every lookup's way; issue 32). A
#: malformed key raises each time (nothing cached).
KEY_CACHE = 4096
_parse_cached = functools.lru_cache(maxsize=KEY_CACHE)(ChunkKey.parse)


def _parse_key(value) -> ChunkKey:
    if not isinstance(value, str):
        raise ValueError(f"expected a chunk key, got {value!r}")
    return _parse_cached(value)


#: how each request field crosses the link: ``(to JSON, from JSON)``; ``bounds`` stays in this
#: process, ``obj`` travels as the frame's buffer
_FIELDS = {
    "keys": (lambda v: [str(k) for k in v], lambda v: _list(v, _parse_key)),
    "known": (list, lambda v: _list(v, _flag)),
    "slots": (lambda v: [list(s) for s in v], lambda v: _list(v, _slot)),
    "timeout_s": (float, _seconds),
    "progress": (int, _int),
    "namespace": (lambda v: v, _namespace),
    "stale": (bool, _flag),
}


class _Request:
    """The wire form of a request dataclass, field by field (:data:`_FIELDS`)."""

    def to_wire(self) -> tuple[dict, list]:
        """``(message fields, buffers)``."""
        message, buffers = {}, []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "obj":
                buffers.append(value)
            elif f.name == "key":
                message["keys"] = [str(value)]
            elif f.name in _FIELDS and (value or f.name not in ("known", "slots")):
                message[f.name] = _FIELDS[f.name][0](value)
        return message, buffers

    @classmethod
    def from_wire(cls, message: dict, buffers: list):
        """The request ``message`` and ``buffers`` carry.

        Raises:
            ValueError: a field that is missing, malformed or inconsistent with the keys.
        """
        values = {}
        for f in fields(cls):
            if f.name == "obj":
                if len(buffers) != 1:
                    raise ValueError("a put carries one object")
                values["obj"] = buffers[0]
            elif f.name == "key":
                keys = _FIELDS["keys"][1](message.get("keys"))
                if len(keys) != 1:
                    raise ValueError("a put carries one key")
                values["key"] = keys[0]
            elif f.name in message:
                values[f.name] = _FIELDS[f.name][1](message[f.name])
        request = cls(**values)
        for name in ("known", "slots"):
            per_key = getattr(request, name, ())
            if per_key and len(per_key) != len(request.keys):
                raise ValueError(f"{name}: not one per key")
        return request


@dataclass(frozen=True)
class KeysRequest(_Request):
    """``contains`` and ``delete``: the keys."""

    keys: Keys = ()


@dataclass(frozen=True)
class LookupRequest(_Request):
    """``lookup``: the keys, and per key whether the client holds its header already (objects
    never change under a key: the shard then sends ``b""`` instead of it)."""

    keys: Keys = ()
    known: tuple[bool, ...] = ()


@dataclass(frozen=True)
class LookupHit:
    """One key found: the tier that answered (``host``, ``disk``, ``redis``, ``s3``), the
    object's prefix and header bytes (``b""`` when the request said the client knows them; the
    client parses and checks them) and where it was found (the shard that answered, or the
    local tier; ``""``: a shared tier read directly)."""

    tier: str
    header: bytes
    source: str


@dataclass(frozen=True)
class LookupAnswer:
    """Per key a :class:`LookupHit` or None (a miss); ``unanswered``: indexes of keys whose
    owner failed to answer (dead, restarting, suspect: a shared tier may still hold them),
    not those of a merely slow owner (misses)."""

    hits: tuple[LookupHit | None, ...]
    unanswered: tuple[int, ...] = ()

    def to_wire(self) -> tuple[dict, list]:
        """One buffer per hit with header bytes (none for the headers the client holds: a
        lookup of known keys is one small frame, not two reads per key)."""
        hits = [None if h is None else {"tier": h.tier, "source": h.source, "header": bool(h.header)}
                for h in self.hits]
        return {"hits": hits, "unanswered": list(self.unanswered)}, [h.header for h in self.hits if h and h.header]

    @classmethod
    def from_wire(cls, value, buffers: list, request: LookupRequest) -> LookupAnswer | None:
        """The answer ``value`` and ``buffers`` (one per hit that carries header bytes)
        describe, or None."""
        try:
            raw, unanswered = value["hits"], tuple(_int(i) for i in value["unanswered"])
            if not isinstance(raw, list) or len(raw) != len(request.keys):
                return None
            if sum(h is not None and h["header"] is True for h in raw) != len(buffers):
                return None
            headers = iter(buffers)
            hits = tuple(None if h is None else LookupHit(h["tier"], bytes(next(headers)) if h["header"] else b"",
                                                          h["source"]) for h in raw)
        except (TypeError, KeyError, ValueError):
            return None
        if any(not 0 <= i < len(hits) for i in unanswered):
            return None
        if any(h is not None and not (isinstance(h.tier, str) and isinstance(h.source, str)) for h in hits):
            return None
        return cls(hits, unanswered)


@dataclass(frozen=True)
class ObjectsRequest(_Request):
    """``objects``: the keys, the seconds the caller waits, per key an upper bound of its
    object's bytes (:func:`cluster.cache.headers.object_bound`: what an arena slot reserves;
    empty: unknown) and, over the link, its slot ``(offset, capacity)`` in the caller's arena
    (empty: no arena, the objects come back as buffers); ``progress``: the offset of the
    call's progress word in the arena (:class:`cluster.cache.arena.Progress`: the agent answers
    once the headers are written and copies the rest in the background), or -1 (it answers
    once every object is written)."""

    keys: Keys = ()
    timeout_s: float = 0.0
    bounds: tuple[int, ...] = ()
    slots: tuple[tuple[int, int], ...] = ()
    progress: int = -1


@dataclass(frozen=True)
class ObjectsAnswer:
    """In this process: per key its whole chunk object (a uint8 array, or None: a miss), whether
    every layer of it was checked as it entered host memory (a shard's host tier: its layers
    are copied unchecked; False: each layer is checked as it is read) and, for an object still
    arriving, the :class:`cluster.cache.arena.Progress` to wait on before reading past its
    header (empty, or None per key: all there)."""

    objects: tuple[np.ndarray | None, ...]
    checked: tuple[bool, ...]
    arriving: tuple = ()


@dataclass(frozen=True)
class SlotsAnswer:
    """``objects`` over the link: per key ``where`` (``"host"``: written into its slot, or sent
    as the next buffer without an arena; ``"refit"``: larger than its slot, nothing written;
    None: a miss) and ``sizes`` (bytes written, or the object's size for ``refit``)."""

    where: tuple[str | None, ...]
    sizes: tuple[int | None, ...]

    def to_wire(self) -> tuple[dict, list]:
        return {"where": list(self.where), "sizes": list(self.sizes)}, []

    @classmethod
    def from_wire(cls, value, buffers: list, request: ObjectsRequest) -> SlotsAnswer | None:
        try:
            where, sizes = tuple(value["where"]), tuple(value["sizes"])
        except (TypeError, KeyError):
            return None
        if len(where) != len(request.keys) or len(sizes) != len(where):
            return None
        if any(w not in (None, "host", "refit") for w in where):
            return None
        if any(s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0) for s in sizes):
            return None
        if not request.slots and len(buffers) != where.count("host"):
            return None
        return cls(where, sizes)


@dataclass(frozen=True)
class PutRequest(_Request):
    """``put``: one chunk object, encoded once in the client's process (never re-encoded on
    its way to the shard's host tier)."""

    key: ChunkKey
    obj: object  # bytes-like


@dataclass(frozen=True)
class FlushRequest(_Request):
    """``flush``: seconds to wait for pending puts and the shards' write-downs."""

    timeout_s: float


@dataclass(frozen=True)
class ClearRequest(_Request):
    """``clear``: every chunk of ``namespace`` (all when None); ``stale``: only objects of
    another chunk format version."""

    namespace: str | None = None
    stale: bool = False


@dataclass(frozen=True)
class StatsRequest(_Request):
    """``stats``: nothing."""


def _flags(value, buffers: list, request: KeysRequest):
    ok = isinstance(value, list) and len(value) == len(request.keys) and all(isinstance(v, bool) for v in value)
    return tuple(value) if ok else None


def _answer_flag(value, buffers: list, request):
    return value if isinstance(value, bool) else None


def _count(value, buffers: list, request):
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _dict(value, buffers: list, request):
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class Op:
    """One operation: its request type, the reader of its answer over the link
    (``answer(value, buffers, request)`` -> the typed answer, or None when malformed), its lane
    and whether its frames carry large buffers."""

    name: str
    request: type
    answer: Callable
    ordered: bool = False
    buffers: bool = False


OPS: dict[str, Op] = {op.name: op for op in (
    Op("lookup", LookupRequest, LookupAnswer.from_wire),
    Op("objects", ObjectsRequest, SlotsAnswer.from_wire, buffers=True),
    Op("contains", KeysRequest, _flags),
    Op("stats", StatsRequest, _dict),
    Op("put", PutRequest, _answer_flag, ordered=True, buffers=True),
    Op("flush", FlushRequest, _answer_flag, ordered=True),
    Op("delete", KeysRequest, _count, ordered=True),
    Op("clear", ClearRequest, _count, ordered=True),
)}


def request_frame(op: str, request) -> tuple[dict, list]:
    """``(message, buffers)`` of ``request`` for op ``op``.

    Raises:
        ValueError: ``op`` is not in :data:`OPS`, or ``request`` is not its request type.
    """
    spec = OPS.get(op)
    if spec is None:
        raise ValueError(f"unknown op {op!r}")
    if not isinstance(request, spec.request):
        raise ValueError(f"op {op!r} takes a {spec.request.__name__}, not {type(request).__name__}")
    message, buffers = request.to_wire()
    return {"op": op, **message}, buffers


class Transport(Protocol):
    """What differs by medium under :class:`cluster.cache.client.CacheClient`.

    The client calls each method from its callers' and its pool's threads; a transport is safe
    for that. No method raises for a cache fault: a dead shard, agent or tier is None (no
    answer: the client counts nothing more and serves misses), False or 0, counted by the
    transport through the client's ``count``. The client checks every header and object it
    gets; a transport checks nothing it forwards.

    Attributes:
        name: ``ray``, ``agent`` or ``local``.
        counters: the counters it adds to the client's (``stats()['client']``).
        remote: keys it could not serve may be read from the shared Redis/S3 tiers directly.
        compress: the encoding its puts carry (lz4 layers: a machine-local disk).
        keep_bytes: bytes of objects the client may keep between requests.
        threaded: the client reads on its own threads (False: in the caller's thread, when a
            layer is asked for: :class:`DeferredRead`).
    """

    name: str
    counters: tuple[str, ...]
    remote: bool
    compress: bool
    keep_bytes: int
    threaded: bool

    def bind(self, host) -> None:
        """Called once by the client: ``host.count(name, n)``, ``host.evict_oldest(keep)`` (drop
        the oldest held object not in ``keep``; False when none is left), ``host.drop_objects()``
        and ``host.placement_changed(owner)``."""

    @property
    def up(self) -> bool:
        """Whether it serves now (the client's chain takes the first transport that does)."""

    def lookup(self, request: LookupRequest) -> LookupAnswer | None: ...

    def objects(self, request: ObjectsRequest) -> ObjectsAnswer: ...

    def put(self, request: PutRequest, done: Callable[[bool], None]) -> bool:
        """Start the put; ``done(stored)`` runs once it settled (stored or refused, or the
        medium failed). False: not sent (then ``done`` never runs)."""

    def contains(self, request: KeysRequest) -> tuple[bool, ...] | None: ...

    def delete(self, request: KeysRequest) -> int | None: ...

    def flush(self, request: FlushRequest) -> bool: ...

    def clear(self, request: ClearRequest) -> int | None: ...

    def stats(self, request: StatsRequest) -> dict: ...

    def close(self) -> None: ...


class DeferredRead(Future):
    """A future whose work runs in the first thread that asks for its result: the client's reads
    over a transport that is not ``threaded`` (a tier in this process: no thread of the client
    reads, and layers a blend never asks for are never read)."""

    def __init__(self, work) -> None:
        super().__init__()
        self._work = work
        self._run_lock = threading.RLock()  # done callbacks may ask again

    def result(self, timeout: float | None = None):
        with self._run_lock:
            if not self.done() and self.set_running_or_notify_cancel():
                try:
                    self.set_result(self._work())
                except BaseException as e:  # noqa: BLE001 - delivered through the future
                    self.set_exception(e)
        return super().result(timeout)
