"""The chunk objects vLLM's process holds from its cache agent: reserved in the shared-memory
arena, asked for in one ``objects`` call per request, checked once, kept between requests.

:class:`AgentObjects` is :class:`~cluster.cache.agent_client.AgentClient`'s object cache.
With an arena (:mod:`cluster.cache.arena`, the default) a read is::

    reserve a slot per object (size bound from the lookup)   -> arena full: a counted miss
    {"op": "objects", "keys", "slots": [[offset, capacity]]}  the agent copies each object in
    {"where": ["host"|"shared"|"refit"|null], "sizes"}        and answers lengths, no bytes
    parse each header in place (tag checked when a key is set), keep the view (LRU)

``refit``: the object is larger than its slot (re-encoded since the lookup); the slot is
freed, the size remembered and that key asked for once more. Without an arena (it could not
be created, or ``agent_arena_gib`` is 0) the objects come over the socket as buffers.

Bounds: objects are kept between requests up to :data:`MAX_KEPT_BYTES` over the socket or
the arena's size (they are dropped oldest first when a reservation needs their room), never
those of the call that just read them; at most :data:`MAX_SIZES` size bounds are remembered.
Lifetimes of slots: :mod:`cluster.cache.arena` (freed with their last view; on a miss, a
timeout, a refused call or a lost agent by the answer's arrival or the link's end).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from cluster.cache.agent_ops import ObjectsAnswer, request
from cluster.cache.arena import Arena
from tiers.format import FormatError, parse_header
from tiers.keys import ChunkKey

log = logging.getLogger("kvblend.client")

#: bytes of chunk objects kept between requests when they come over the socket
MAX_KEPT_BYTES = 256 << 20
#: object size bounds remembered from lookups
MAX_SIZES = 65536

#: (object bytes, its own header, came from a shared tier: its layers are authenticated here)
Held = tuple[np.ndarray, object, bool]
#: ``call(message, on_done) -> (result, buffers) | None``: one agent call within the objects
#: deadline; ``on_done`` runs once the call's future completes (answered, failed, or refused)
Call = Callable[[dict, Callable[[object], None]], tuple | None]


class AgentObjects:
    """Objects read from one agent at a time (see the module docstring).

    Args:
        count: ``count(counter, n)`` of the owning client (``read_errors``, ``arena_full``,
            ``arena_refits``).
    """

    def __init__(self, count: Callable[[str, int], None]) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._held: OrderedDict[ChunkKey, Held] = OrderedDict()
        self._sizes: OrderedDict[ChunkKey, int] = OrderedDict()
        self.arena: Arena | None = None
        self._cuda = False  # page-lock every arena for CUDA (a CUDA worker stages from it)

    def use_cuda(self) -> None:
        """A CUDA worker stages from these objects: register the arena (and every later
        one) with CUDA, so its objects go to the GPU with no staging copy."""
        self._cuda = True
        arena = self.arena
        if arena is not None:
            arena.register_cuda()

    def device_readable(self, arr: np.ndarray) -> bool:
        """Whether the copy engine can read ``arr`` directly (it lies in a registered arena)."""
        arena = self.arena
        return arena is not None and arena.registered and arena.holds(arr)

    # -- the agent's life --------------------------------------------------------------------
    def new_arena(self, nbytes: int) -> Arena | None:
        """A fresh arena for the agent about to start (the previous one retired); None when
        ``nbytes`` is 0 or the system refuses one (then objects come over the socket)."""
        self.retire()
        arena = None
        if nbytes > 0:
            try:
                arena = Arena(nbytes)
                if self._cuda:
                    arena.register_cuda()
            except OSError as e:
                log.warning("kvblend: no shared-memory arena of %d bytes (%s); chunk objects come "
                            "over the agent's socket", nbytes, e)
        with self._lock:
            self.arena = arena
        return arena

    def retire(self) -> None:
        """The agent is gone (or the client closes): forget every object, retire the arena."""
        with self._lock:
            arena, self.arena = self.arena, None
            self._held.clear()
        if arena is not None:
            arena.retire()

    def forget(self, keys=None) -> None:
        """Drop held objects of ``keys`` (all when None)."""
        with self._lock:
            if keys is None:
                self._held.clear()
            for k in keys or ():
                self._held.pop(k, None)

    def note_size(self, key: ChunkKey, nbytes: int) -> None:
        """Remember an upper bound of ``key``'s object size (from a lookup answer)."""
        with self._lock:
            self._sizes[key] = int(nbytes)
            self._sizes.move_to_end(key)
            while len(self._sizes) > MAX_SIZES:
                self._sizes.popitem(last=False)

    def knows(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._sizes

    def stats(self) -> dict[str, int]:
        arena = self.arena
        with self._lock:
            held = sum(h[0].nbytes for h in self._held.values())
        out = {"arena_bytes": 0, "arena_used_bytes": 0, "arena_peak_bytes": 0}
        if arena is not None:
            out.update(arena.stats())
        return {**out, "objects_held_bytes": held}

    # -- reads ---------------------------------------------------------------------------------
    def read(self, keys: list[ChunkKey], call: Call) -> list[Held | None]:
        """Per key its object (held already, or read through ``call`` now), or None."""
        with self._lock:
            got: list[Held | None] = [self._held.get(k) for k in keys]
        need = [i for i, h in enumerate(got) if h is None]
        if need:
            arena = self.arena
            if arena is None:
                self._over_socket(keys, need, got, call)
            else:
                refit = self._into_arena(arena, keys, need, got, call)
                if refit:
                    self._into_arena(arena, keys, refit, got, call)
        with self._lock:
            for k, h in zip(keys, got, strict=True):
                if h is not None:
                    self._held[k] = h
                    self._held.move_to_end(k)
            self._trim(set(keys), MAX_KEPT_BYTES if self.arena is None else self.arena.nbytes)
        return got

    def _trim(self, keep: set, bound: int) -> None:
        """Drop held objects oldest first until at most ``bound`` bytes, never those in
        ``keep``. Call with the lock held."""
        held = sum(h[0].nbytes for h in self._held.values())
        for k in list(self._held):
            if held <= bound:
                break
            if k not in keep:
                held -= self._held.pop(k)[0].nbytes

    def _reserve(self, arena: Arena, nbytes: int, keep: set):
        """A slot, dropping held objects (oldest first, not ``keep``) to make room; None when
        even that does not free enough (views of them are still in use, or the arena is
        smaller than the request)."""
        slot = arena.reserve(nbytes)
        while slot is None:
            with self._lock:
                victim = next((k for k in self._held if k not in keep), None)
                if victim is None:
                    return None
                dropped = self._held.pop(victim)
            del dropped  # the last reference: its slot is free now unless a reader holds a view
            slot = arena.reserve(nbytes)
        return slot

    def _into_arena(self, arena: Arena, keys, need: list[int], got: list, call: Call) -> list[int]:
        """Read ``need`` into arena slots; fills ``got``; the indexes to ask for again (refit)."""
        keep = set(keys)
        slots: dict[int, object] = {}
        for i in need:
            with self._lock:
                bound = self._sizes.get(keys[i])
            if bound is None:
                continue  # not found by a lookup: a miss
            slot = self._reserve(arena, bound, keep)
            if slot is None:
                self._count("arena_full", 1)
                continue
            slots[i] = slot
        if not slots:
            return []
        order = list(slots)
        state = {"finished": False, "abandoned": False}
        lock = threading.Lock()

        def release_all() -> None:
            for s in slots.values():
                s.release()

        def on_done(_fut) -> None:  # the answer arrived, the call failed, or it was refused
            with lock:
                state["finished"] = True
                free = state["abandoned"]
            if free:
                release_all()

        message = request("objects", [keys[i] for i in order],
                          slots=[[slots[i].offset, slots[i].nbytes] for i in order])
        answer = call(message, on_done)
        parsed = self._parse(answer, len(order))
        if parsed is None:  # no usable answer: the slots wait for the call's end
            with lock:
                state["abandoned"] = True
                free = state["finished"]
            if free:
                release_all()
            return []
        refit = []
        for j, i in enumerate(order):
            slot, w, n = slots[i], parsed.where[j], parsed.sizes[j]
            if w in ("host", "shared") and isinstance(n, int) and 0 < n <= slot.nbytes:
                got[i] = self._own(keys[i], slot.view(n), shared=w == "shared")
            else:
                slot.release()
                if w == "refit" and isinstance(n, int) and n > slot.nbytes:
                    self.note_size(keys[i], n)
                    self._count("arena_refits", 1)
                    refit.append(i)
        return refit

    def _over_socket(self, keys, need: list[int], got: list, call: Call) -> None:
        answer = call(request("objects", [keys[i] for i in need]), lambda _f: None)
        parsed = self._parse(answer, len(need))
        if parsed is None:
            return
        it = iter(answer[1])
        for i, w in zip(need, parsed.where, strict=True):
            if w in ("host", "shared"):
                buf = next(it, None)
                if buf is None:
                    return
                got[i] = self._own(keys[i], np.frombuffer(buf, dtype=np.uint8), shared=w == "shared")

    def _parse(self, answer, n: int) -> ObjectsAnswer | None:
        """The objects answer for ``n`` keys, or None (no answer; a malformed one is counted
        ``read_errors``)."""
        if answer is None:
            return None
        parsed = ObjectsAnswer.from_wire(answer[0], n)
        if parsed is None:
            self._count("read_errors", 1)
        return parsed

    def _own(self, key: ChunkKey, arr: np.ndarray, *, shared: bool) -> Held | None:
        """The object and its header (the header's tag checked when a key is set)."""
        try:
            return arr, parse_header(memoryview(arr), expected_key=key), shared
        except FormatError as err:
            log.debug("object of %s rejected: %s", key, err)
            self._count("read_errors", 1)
            return None
