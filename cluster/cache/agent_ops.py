"""The cache agent's operations, declared once: both ends of the link dispatch from :data:`OPS`.

Each request frame is ``{"id", "op", "keys": [str(ChunkKey)], <the op's fields>}`` plus the
op's buffers; each answer ``{"id", "ok": true, "result"}`` (or ``"error"``) plus buffers. The
vLLM side builds requests with :func:`request` (an op or field the table does not declare is a
``ValueError`` at the call) and reads the answers of ``lookup`` and ``objects`` with
:meth:`LookupHit.from_wire` and :meth:`ObjectsAnswer.from_wire`, those of ``contains``,
``flush``, ``delete`` and ``clear`` with :func:`answer_of` (a malformed answer is a miss,
never an exception); :class:`cluster.cache.agent.Agent` answers each op with its method
``op_<name>`` (every op of the table has one: checked when an agent is built) on the lane the
table gives.

=========  =======  =======  ==============================================================
op         lane     buffers  request fields -> result
=========  =======  =======  ==============================================================
lookup     any      -        keys -> per key a :class:`LookupHit` as a dict, or null
objects    any      answer   keys, slots ([offset, capacity] per key, in the arena) ->
                             :class:`ObjectsAnswer`; without ``slots`` the objects come back
                             as the answer's buffers (no arena)
contains   any      -        keys -> [bool]
stats      any      -        -> the agent client's statistics, plus the agent's own counters
put        ordered  request  keys (one), the encoded chunk object as the buffer -> null
flush      ordered  -        timeout_s -> bool
delete     ordered  -        keys -> int
clear      ordered  -        namespace -> int
=========  =======  =======  ==============================================================

``ordered`` ops are answered one at a time in arrival order (a flush waits for the puts sent
before it); the others run side by side on the agent's worker threads, so a slow object read
never delays a lookup. ``buffers`` marks the ops whose frames carry large heap buffers, after
which the agent asks for a heap trim (:mod:`cluster.heap`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One agent operation: its request fields (beyond ``keys``), its lane and whether its
    frames carry large buffers."""

    name: str
    fields: tuple[str, ...] = ()
    ordered: bool = False
    buffers: bool = False


OPS: dict[str, Op] = {op.name: op for op in (
    Op("lookup"),
    Op("objects", ("slots",), buffers=True),
    Op("contains"),
    Op("stats"),
    Op("put", ordered=True, buffers=True),
    Op("flush", ("timeout_s",), ordered=True),
    Op("delete", ordered=True),
    Op("clear", ("namespace",), ordered=True),
)}


def request(op: str, keys=(), **fields) -> dict:
    """The request frame of ``op`` (``keys``: ChunkKeys or their text).

    Raises:
        ValueError: ``op`` is not in :data:`OPS`, or a field it does not declare.
    """
    spec = OPS.get(op)
    if spec is None:
        raise ValueError(f"unknown agent op {op!r}")
    extra = set(fields) - set(spec.fields)
    if extra:
        raise ValueError(f"agent op {op!r} takes no field(s) {sorted(extra)}")
    return {"op": op, "keys": [str(k) for k in keys], **fields}


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an int, got {value!r}")
    return value


@dataclass(frozen=True)
class LookupHit:
    """One key's lookup answer.

    Attributes:
        num_tokens: tokens of the chunk.
        runs: K's stored positions as ``(start, length)`` runs (:func:`tiers.format.positions_to_runs`).
        tier: the tier that answered (``host``, ``disk``, ``redis``, ``s3``).
        object_bound: bytes the chunk's object may take in any encoding
            (:func:`cluster.cache.agent.object_bound`): what the vLLM side reserves in its
            arena (0: unknown).
    """

    num_tokens: int
    runs: tuple[tuple[int, int], ...]
    tier: str
    object_bound: int

    def positions(self) -> tuple[int, ...]:
        """One position per token."""
        return tuple(p for start, n in self.runs for p in range(start, start + n))

    def to_wire(self) -> dict:
        return {"tokens": self.num_tokens, "runs": [list(r) for r in self.runs], "tier": self.tier,
                "bound": self.object_bound}

    @classmethod
    def from_wire(cls, value) -> LookupHit | None:
        """The hit ``value`` describes, or None (null, or anything malformed: a miss)."""
        try:
            runs = tuple((_int(s), _int(n)) for s, n in value["runs"])
            hit = cls(_int(value["tokens"]), runs, str(value["tier"]), _int(value["bound"]))
        except (TypeError, KeyError, ValueError):
            return None
        if not isinstance(value["tier"], str) or hit.object_bound < 0:
            return None
        if hit.num_tokens != sum(n for _, n in runs) or any(s < 0 or n < 1 for s, n in runs):
            return None
        return hit


@dataclass(frozen=True)
class ObjectsAnswer:
    """The answer of ``objects``: per key ``where`` (``"host"``: the owner shard's host tier,
    ``"shared"``: read from Redis or S3, checked whole; ``"refit"``: larger than its slot,
    nothing written; None: a miss) and ``sizes`` (bytes written into the slot, or the object's
    size for ``refit``; None otherwise)."""

    where: tuple[str | None, ...]
    sizes: tuple[int | None, ...]

    def to_wire(self) -> dict:
        return {"where": list(self.where), "sizes": list(self.sizes)}

    @classmethod
    def from_wire(cls, value, num_keys: int) -> ObjectsAnswer | None:
        """The answer ``value`` describes for ``num_keys`` keys, or None when malformed."""
        try:
            where = tuple(value["where"])
            sizes = tuple(value["sizes"])
        except (TypeError, KeyError):
            return None
        if len(where) != num_keys or len(sizes) != num_keys:
            return None
        if any(w not in (None, "host", "shared", "refit") for w in where):
            return None
        if any(s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0) for s in sizes):
            return None
        return cls(where, sizes)


def answer_of(op: str, value, num_keys: int = 0):
    """The result of ``contains`` (``[bool] * num_keys``), ``flush`` (bool), ``delete`` or
    ``clear`` (an int >= 0) that ``value`` is, or None when it is not that (malformed: the
    caller counts it and answers as for no answer)."""
    if op == "contains":
        ok = isinstance(value, list) and len(value) == num_keys and all(isinstance(v, bool) for v in value)
        return value if ok else None
    if op == "flush":
        return value if isinstance(value, bool) else None
    if op in ("delete", "clear"):
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
    raise ValueError(f"answer_of reads contains, flush, delete and clear, not {op!r}")
