"""How chunk objects cross from the cache agent into vLLM's process: the shared-memory arena
vLLM's process owns, one ``objects`` call per request.

:class:`AgentObjects` is :class:`~cluster.cache.agent_transport.AgentTransport`'s arena side.
With an arena (:mod:`cluster.cache.arena`, the default) a read is::

    reserve a slot per object (size bound from its header)    -> arena full: a counted miss
    and an 8-byte progress word
    {"op": "objects", "keys", "slots": [[offset, capacity]],  the agent copies each object's
     "progress": offset}                                      header in and answers lengths
    {"where": ["host"|"refit"|null], "sizes"}                 (no bytes), then copies the rest
    each object a view of its slot                            in rounds (arena.Progress): the
                                                              client checks each header at once
                                                              and waits per layer as it reads

``refit``: the object is larger than its slot (re-encoded since the lookup); the slot is
freed and that key asked for once more with a slot of its size. Without an arena (it could
not be created, or ``agent_arena_gib`` is 0) the objects come over the socket as buffers.

Room: the client holds objects between requests (its held-object LRU, bounded by the arena's
size); when a slot does not fit, the client drops its oldest held objects (never those of the
request) until it does, and the read is a miss (``arena_full``) when even that is not enough
— never a wait. Lifetimes of slots: :mod:`cluster.cache.arena` (freed with their last view; on
a miss, a timeout, a refused call or a lost agent by the answer's arrival or the link's end).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from cluster.cache.arena import Arena, Progress
from cluster.cache.ops import ObjectsAnswer, ObjectsRequest, SlotsAnswer

log = logging.getLogger("kvblend.client")

#: bytes of chunk objects the client keeps between requests when they come over the socket
MAX_KEPT_BYTES = 256 << 20

#: ``call(request, on_done) -> (SlotsAnswer, buffers) | None``: one agent ``objects`` call within
#: the objects deadline (None: no usable answer); ``on_done`` runs once the call's future
#: completes (answered, failed, refused)
Call = Callable[[ObjectsRequest, Callable[[object], None]], "tuple[SlotsAnswer, list] | None"]


class AgentObjects:
    """The arena of one agent at a time and the objects read through it.

    Args:
        count: ``count(counter, n)`` of the client (``arena_full``, ``arena_refits``).
        on_retire: called when an arena retires (the client then drops the objects it holds
            in it: a new agent starts with an empty arena, and the old one's memory goes back).
    """

    def __init__(self, count: Callable[[str, int], None], on_retire: Callable[[], None] = lambda: None) -> None:
        self._count = count
        self._on_retire = on_retire
        self._lock = threading.Lock()
        self.arena: Arena | None = None
        self._cuda = False  # page-lock every arena for CUDA (a CUDA worker stages from it)

    @property
    def keep_bytes(self) -> int:
        """Bytes of objects the client may keep between requests: the arena's size."""
        arena = self.arena
        return MAX_KEPT_BYTES if arena is None else arena.nbytes

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
        """The agent is gone (or the client closes): no slot of its arena is handed out again
        (its memory goes back with the last view of it)."""
        with self._lock:
            arena, self.arena = self.arena, None
        if arena is not None:
            arena.retire()
            self._on_retire()

    def stats(self) -> dict[str, int]:
        arena = self.arena
        return arena.stats() if arena is not None else {"arena_bytes": 0, "arena_used_bytes": 0,
                                                        "arena_peak_bytes": 0}

    # -- reads ---------------------------------------------------------------------------------
    def read(self, request: ObjectsRequest, call: Call, evict: Callable[[set], bool]) -> ObjectsAnswer:
        """Per key of ``request`` its object (a view of its arena slot, or a buffer), or None,
        and the progress of those still arriving; ``evict(keep)`` drops one object the client
        holds to make room."""
        n = len(request.keys)
        got: list = [None] * n
        arriving: list = [None] * n
        arena = self.arena
        if arena is None:
            self._over_socket(request, got, call)
        else:
            keep = set(request.keys)
            bounds = list(request.bounds) or [0] * n
            refit = self._into_arena(arena, request, range(n), bounds, got, arriving, call, keep, evict)
            if refit:
                self._into_arena(arena, request, refit, bounds, got, arriving, call, keep, evict)
        return ObjectsAnswer(tuple(got), (True,) * n, tuple(arriving))  # host memory: checked as it entered

    def _reserve(self, arena: Arena, nbytes: int, keep: set, evict: Callable[[set], bool]):
        """A slot, the client dropping held objects (oldest first, not ``keep``) to make room;
        None when even that does not free enough (views of them are still in use, or the arena
        is smaller than the request)."""
        slot = arena.reserve(nbytes)
        while slot is None and evict(keep):
            slot = arena.reserve(nbytes)
        return slot

    def _into_arena(self, arena: Arena, request: ObjectsRequest, todo, bounds: list, got: list,
                    arriving: list, call: Call, keep: set, evict: Callable[[set], bool]) -> list[int]:
        """Read ``todo`` (indexes) into arena slots, pipelined when a progress word fits too;
        fills ``got`` and ``arriving``; the indexes to ask for again (refit: ``bounds`` updated)."""
        slots: dict[int, object] = {}
        for i in todo:
            if bounds[i] <= 0:
                continue  # size unknown: a miss
            slot = self._reserve(arena, bounds[i], keep, evict)
            if slot is None:
                self._count("arena_full", 1)
                continue
            slots[i] = slot
        if not slots:
            return []
        word = self._reserve(arena, 8, keep, evict)
        progress = None if word is None else Progress(word)
        del word  # the progress holds its slot now
        order = list(slots)
        state = {"finished": False, "abandoned": False, "copying": False}
        lock = threading.Lock()

        def release_all() -> None:  # the agent may still copy into them only if it answered
            for s in [*slots.values(), *([] if progress is None else [progress.slot])]:
                if state["copying"] and progress is not None:
                    arena.give_back_after(s, progress.done)
                else:
                    s.release()

        def on_done(fut) -> None:  # the answer arrived, the call failed, or it was refused
            with lock:
                state["finished"] = True
                state["copying"] = fut is not None and fut.exception() is None
                free = state["abandoned"]
            if free:
                release_all()

        sub = ObjectsRequest(tuple(request.keys[i] for i in order), request.timeout_s,
                             slots=tuple((slots[i].offset, slots[i].nbytes) for i in order),
                             progress=-1 if progress is None else progress.offset)
        reply = call(sub, on_done)
        if reply is None:  # no usable answer: the slots wait for the call's end (and its copy)
            with lock:
                state["abandoned"] = True
                free = state["finished"]
            if free:
                release_all()
            return []
        answer, refit = reply[0], []
        for j, i in enumerate(order):
            slot, w, n = slots[i], answer.where[j], answer.sizes[j]
            if w == "host" and isinstance(n, int) and 0 < n <= slot.nbytes:
                got[i], arriving[i] = slot.view(n, progress), progress
            else:
                slot.release()  # nothing written there
                if w == "refit" and isinstance(n, int) and n > slot.nbytes:
                    bounds[i] = n
                    self._count("arena_refits", 1)
                    refit.append(i)
        return refit

    def _over_socket(self, request: ObjectsRequest, got: list, call: Call) -> None:
        reply = call(request, lambda _f: None)
        if reply is None:
            return
        answer, buffers = reply
        it = iter(buffers)  # one per "host" (SlotsAnswer.from_wire checked the count)
        for i, w in enumerate(answer.where):
            if w == "host":
                got[i] = np.frombuffer(next(it), dtype=np.uint8)
