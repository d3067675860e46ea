"""The shared-memory arena through which the cache agent hands chunk objects to vLLM's process.

Why (issue 32): over the agent's Unix socket the 1 GiB of KV of an 8K-token prompt reached
the H200 in 1.01 s (1.06 GB/s, two kernel copies and a user copy per byte), 15x the same
bytes read in-process. Here the bytes cross once, by one ``memcpy`` in the agent::

    Ray object store (the agent maps the shard's object, zero-copy on the node)
      |  the agent: np.copyto into the slot the vLLM side reserved (GIL released,
      v  :data:`COPY_THREADS` threads for a large object)
    arena slot (memfd pages mapped MAP_SHARED by both processes)
      |  vLLM's process reads the object in place: headers parsed and layers sliced as views;
      v  fetch_layer copies a layer once (the engine may write into what it gets), the CUDA
         worker's staging copies it onto the GPU (the arena registered: no pinned slot)

Pipelined (issue 32: the copy overlaps the reads). The agent copies each object's header into
its slot, answers, then copies the rest in :data:`ROUNDS` rounds in the background (up to
half of :data:`COPY_THREADS` threads, each a stripe of every round), the same share of every
object in each round, writing the rounds every stripe has done into the request's progress word
(:class:`Progress`, 8 bytes in a slot of their own). A reader waits (:meth:`Progress.wait`, polled
every :data:`POLL_S`, bounded by its deadline) only for the round that holds the layer it reads,
so layer 0 is read while later layers are still being copied (the CUDA worker's staging waits
for whole objects). Measured with ``kvblend bench cluster`` on the 2-core dev VM, 16 objects of
8 MiB: the objects call took 23 ms before the reads could start, 7.5 ms pipelined.

Ownership. vLLM's process owns the arena (:class:`Arena`): it creates the memfd, gives it to
each agent it starts (an inherited file descriptor, named in the hello frame) and reserves a
slot per object before it asks for the objects; the agent (:class:`ArenaWriter`) writes only
into slots named in the request, only within the arena, and answers with each object's
length. Lifetimes:

* a slot whose object came back becomes the array :meth:`Slot.view` returns; the slot is
  free again when the last view of it is gone (``weakref.finalize`` on that array: the
  client's object LRU, a staging request or the pinned store's background copy may each
  hold one);
* a slot whose object did not come (a miss, an object larger than the slot) is freed when
  the answer arrives; one whose call timed out or was refused is freed when its answer
  finally arrives or the link closes (a late write of the agent can only land in a slot
  nobody else holds);
* a slot (and the progress word) of an object still being copied is freed only once the
  copy is done (the progress word says so) or the agent is gone: a slot the agent may still
  write is never reserved again;
* every agent gets a fresh arena: when an agent dies (killed mid-read included) its arena
  is retired, no slot of it is handed out again, and its memory goes back to the system
  once the last view of it is gone. So an agent that is still writing while it is killed
  can never touch an object a reader holds.

Pages: the memfd's pages are allocated as they are first written and stay allocated when a
slot is freed (reservations are first fit from offset 0, so later requests write resident
pages). A first touch is slow on a VM (1 s per 128 MiB, both sides' faults, on the 2-core dev
VM), so a new agent's first requests pay it once; a CUDA worker registers the arena, which
commits every page when the staging source starts.

Bound: the arena never grows; a reservation that does not fit (after the client dropped
objects it kept from earlier requests) is refused, and the read is a counted miss
(``arena_full``), never a wait.
"""

from __future__ import annotations

import bisect
import functools
import logging
import mmap
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tiers.format import PREFIX_BYTES, FormatError, parse_prefix

log = logging.getLogger("kvblend.client")

#: slot offsets and sizes are multiples of this (a page: DMA-friendly, no false sharing)
ALIGN = 4096
#: threads the agent copies a request's objects with (numpy releases the GIL while copying;
#: on the H200's host one thread copies ~10 GB/s)
COPY_THREADS = max(1, min(8, os.cpu_count() or 1))
#: pieces of an object copied by one thread are at least this long
_PARALLEL_BYTES = 8 << 20
#: rounds in which the agent copies a request's objects after their headers (one round per layer
#: of a 32-layer chunk; a reader waits for the round that holds the bytes it reads)
ROUNDS = 32
#: seconds between two looks at a progress word
POLL_S = 50e-6
#: held around every progress word write and read: a barrier between the copied bytes and the
#: word that says they are there (x86 keeps stores in order; weaker orders need the fence)
_FENCE = threading.Lock()


def rounds_for(end: int, header_end: int, size: int) -> int:
    """The round after which bytes ``[0, end)`` of an object of ``size`` bytes, its header
    ``[0, header_end)``, are in its slot (0: the header, copied before the answer)."""
    if end <= header_end:
        return 0
    step = -(-(size - header_end) // ROUNDS)
    return min(ROUNDS, -(-(end - header_end) // step))


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Slot:
    """A reserved range ``[offset, offset + nbytes)`` of an :class:`Arena`; freed once, by
    :meth:`release` or when the last array from :meth:`view` is collected."""

    __slots__ = ("arena", "offset", "nbytes", "_freed", "__weakref__")

    def __init__(self, arena: Arena, offset: int, nbytes: int) -> None:
        self.arena, self.offset, self.nbytes = arena, offset, nbytes
        self._freed = False

    def release(self) -> None:
        """Give the range back (idempotent; only for a slot never viewed)."""
        self.arena._give_back(self)

    def view(self, length: int, progress: Progress | None = None) -> np.ndarray:
        """The slot's first ``length`` bytes as a read-only uint8 array over the shared pages (no
        copy); the slot is freed when this array and every view of it are gone (and, with the
        request's ``progress``, the agent's copy into it is done).

        Raises:
            ValueError: ``length`` is negative or larger than the slot.
        """
        if not 0 <= length <= self.nbytes:
            raise ValueError(f"length {length} outside a slot of {self.nbytes} bytes")
        arr = np.frombuffer(self.arena._mm, dtype=np.uint8, count=length, offset=self.offset)
        arr.flags.writeable = False  # readers share it (the object is kept for later requests)
        if progress is None:
            weakref.finalize(arr, self.arena._give_back, self)
        else:  # not before the agent's copy into it is done
            weakref.finalize(arr, self.arena.give_back_after, self, progress.done)
        return arr


class Arena:
    """A bounded shared-memory region (a memfd) of ``nbytes``, split into :class:`Slot` s.

    Args:
        nbytes: the arena's size in bytes (rounded up to :data:`ALIGN`); memory is committed
            only as pages are written.
        name: the memfd's name (``/proc/<pid>/fd`` shows it).

    Raises:
        OSError: the system refuses the memfd or its size.
    """

    def __init__(self, nbytes: int, name: str = "kvblend-agent-arena") -> None:
        self.nbytes = _round_up(max(ALIGN, int(nbytes)))
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._mm = mmap.mmap(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), by offset
        self._deferred: list[tuple[Slot, object]] = []  # (slot, done()): freed once done
        self.used = 0
        self.peak = 0
        self.retired = False
        self.base = int(np.frombuffer(self._mm, dtype=np.uint8).ctypes.data)
        self.registered = False

    def register_cuda(self) -> bool:
        """Page-lock the arena for CUDA (``cudaHostRegister``, portable: every context of this
        process), so the copy engine reads its objects straight into device memory with no
        staging copy. Commits the arena's memory now. Unregistered when the arena and every
        view of it are gone. False (logged) when CUDA refuses; the arena works unregistered."""
        if self.registered:
            return True
        import torch

        err = int(torch.cuda.cudart().cudaHostRegister(self.base, self.nbytes, 1))
        if err != 0:
            log.warning("kvblend: cudaHostRegister of the %d-byte agent arena failed (cudaError %d); "
                        "its objects are staged through pinned slots", self.nbytes, err)
            return False
        self.registered = True
        weakref.finalize(self, _unregister, self.base, self._mm)  # holds the mapping until then
        return True

    def holds(self, arr: np.ndarray) -> bool:
        """Whether ``arr``'s bytes lie inside this arena."""
        ptr = int(arr.ctypes.data)
        return self.base <= ptr and ptr + arr.nbytes <= self.base + self.nbytes

    def reserve(self, nbytes: int) -> Slot | None:
        """A slot of at least ``nbytes`` (first fit), or None when none is free (or retired)."""
        need = _round_up(max(1, int(nbytes)))
        self._sweep()
        with self._lock:
            if self.retired:
                return None
            for i, (off, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, size - need)
                    self.used += need
                    self.peak = max(self.peak, self.used)
                    return Slot(self, off, need)
        return None

    def give_back_after(self, slot: Slot, done) -> None:
        """Free ``slot`` now if ``done()``, else once it is (looked at with each reservation)."""
        if done():
            self._give_back(slot)
        else:
            with self._lock:
                self._deferred.append((slot, done))

    def _sweep(self) -> None:
        """Free the deferred slots whose copy is done."""
        with self._lock:
            if not self._deferred:
                return
            deferred, self._deferred = self._deferred, []
        for slot, done in deferred:
            self.give_back_after(slot, done)

    def _give_back(self, slot: Slot) -> None:
        with self._lock:
            if slot._freed:
                return
            slot._freed = True
            self.used -= slot.nbytes
            off, size = slot.offset, slot.nbytes
            i = bisect.bisect_left(self._free, (off, 0))
            if i < len(self._free) and self._free[i][0] == off + size:  # merge with the next
                size += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # and the previous
                off, size = self._free[i - 1][0], self._free[i - 1][1] + size
                self._free[i - 1] = (off, size)
            else:
                self._free.insert(i, (off, size))

    def close_fd(self) -> None:
        """Close this process's descriptor of the memfd (once the agent inherited its own);
        the mapping stays. Idempotent."""
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def retire(self) -> None:
        """No more reservations (its agent is gone); the mapping lives on while views of it
        do, and its memory goes back to the system with the last one."""
        with self._lock:
            self.retired = True
        self.close_fd()

    def stats(self) -> dict[str, int]:
        self._sweep()
        with self._lock:
            return {"arena_bytes": self.nbytes, "arena_used_bytes": self.used,
                    "arena_peak_bytes": self.peak}


class Progress:
    """The progress word of one pipelined ``objects`` call (vLLM's side): how many of the
    :data:`ROUNDS` rounds the agent has copied into the call's slots.

    Args:
        slot: a slot of at least 8 bytes for the word (zeroed here, before the call); freed
            once the copy is done and neither this nor a view of the call's objects is left
            (or at once by the caller whose call never reached the agent).
    """

    def __init__(self, slot: Slot) -> None:
        arena = slot.arena
        self._arena = arena
        self._word = np.frombuffer(arena._mm, dtype=np.uint64, count=1, offset=slot.offset)
        self._word[0] = 0
        self.slot, self.offset = slot, slot.offset
        weakref.finalize(self, arena.give_back_after, slot, functools.partial(_copied, arena, self._word))

    def done(self) -> bool:
        """Whether the agent will write no more into the call's slots (copied, or it is gone)."""
        return _copied(self._arena, self._word)

    def wait(self, end: int, header_end: int, size: int, deadline: float) -> bool:
        """Wait until bytes ``[0, end)`` of one object of the call (``size`` bytes, header
        ``header_end``) are in its slot; False at ``deadline`` (``time.monotonic()``) or when
        the agent is gone."""
        need = rounds_for(end, header_end, size)
        while _rounds(self._word) < need:
            if self._arena.retired or time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True


def _rounds(word: np.ndarray) -> int:
    with _FENCE:
        return int(word[0])


def _copied(arena: Arena, word: np.ndarray) -> bool:
    return arena.retired or _rounds(word) >= ROUNDS


def _unregister(ptr: int, _mapping) -> None:
    """Undo :meth:`Arena.register_cuda` (the arena and all its views are gone; ``_mapping``
    kept the pages mapped until now)."""
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception as e:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
        log.debug("cudaHostUnregister of the agent arena failed: %s", e)


class ArenaWriter:
    """The agent's side of an :class:`Arena`: the same memfd mapped read-write.

    Args:
        fd: the inherited memfd (closed here once mapped).
        nbytes: its size, as the hello frame says (checked against the file's).

    Raises:
        OSError, ValueError: the descriptor is not a file of ``nbytes`` bytes.
    """

    def __init__(self, fd: int, nbytes: int) -> None:
        try:
            size = os.fstat(fd).st_size
            if size != nbytes or nbytes <= 0:
                raise ValueError(f"arena descriptor holds {size} bytes, hello says {nbytes}")
            self._mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kvblend-agent-copy")

    def target(self, offset, capacity, obj) -> tuple[np.ndarray, np.ndarray]:
        """``(destination, source)`` uint8 arrays of one object's copy into its slot.

        Raises:
            ValueError: a slot outside the arena, or an object larger than its slot.
        """
        src = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj.reshape(-1).view(np.uint8)
        if not (isinstance(offset, int) and isinstance(capacity, int)
                and 0 <= offset and 0 <= capacity and offset + capacity <= self.nbytes):
            raise ValueError(f"slot [{offset}, +{capacity}) outside an arena of {self.nbytes} bytes")
        if src.nbytes > capacity:
            raise ValueError(f"object of {src.nbytes} bytes does not fit a slot of {capacity}")
        return self._buf[offset:offset + src.nbytes], src

    def write(self, offset: int, capacity: int, obj) -> int:
        """Copy ``obj`` (any buffer) into the slot ``[offset, offset + capacity)``; its length.
        Raises ValueError as :meth:`write_many` does."""
        return self.write_many([(offset, capacity, obj)])[0]

    def write_progressively(self, items, progress_offset: int) -> list[int]:
        """Copy each ``(offset, capacity, obj)``'s header into its slot now and the rest in the
        background (:data:`ROUNDS` rounds, the rounds done written into the 8-byte progress word
        at ``progress_offset``); their lengths. Raises ValueError as :meth:`write_many` does, or
        for a progress word outside the arena, before anything is written."""
        pairs = [self.target(o, c, obj) for o, c, obj in items]
        word = self.target(progress_offset, 8, b"\0" * 8)[0].view(np.uint64)
        heads = []
        for dst, src in pairs:
            try:
                head = min(src.nbytes, PREFIX_BYTES + parse_prefix(src))
            except FormatError:
                head = src.nbytes  # not a chunk object: copied whole now
            np.copyto(dst[:head], src[:head])
            heads.append(head)
        rest = sum(src.nbytes - head for (_dst, src), head in zip(pairs, heads, strict=True))
        # half the copy threads: the readers it pipelines with need cores too (2-core VM, kvblend
        # bench cluster: agent reads 3.43-3.68 GB/s with 2 stripes, 3.68-3.88 with 1)
        stripes = max(1, min(COPY_THREADS // 2, rest // _PARALLEL_BYTES))
        done = [0] * stripes
        for stripe in range(stripes):
            self._pool.submit(_copy_rounds, pairs, heads, word, stripe, done)
        return [src.nbytes for _dst, src in pairs]

    def write_many(self, items) -> list[int]:
        """Copy each ``(offset, capacity, obj)`` into its slot, all of them at once in pieces
        over :data:`COPY_THREADS` threads (the request's objects in parallel, not one after
        another); their lengths. Raises ValueError for a slot outside the arena or an object
        larger than its slot, before anything is written."""
        pairs = [self.target(o, c, obj) for o, c, obj in items]
        pieces = []
        for dst, src in pairs:
            step = max(_PARALLEL_BYTES, _round_up(-(-src.nbytes // COPY_THREADS)))
            pieces += [(dst[i:i + step], src[i:i + step]) for i in range(0, src.nbytes, step)]
        if len(pieces) == 1:
            np.copyto(*pieces[0])
        else:
            jobs = [self._pool.submit(_copy_all, pieces[g::COPY_THREADS]) for g in range(min(COPY_THREADS, len(pieces)))]
            for job in jobs:
                job.result()
        return [src.nbytes for _dst, src in pairs]


def _copy_all(pieces) -> None:
    for dst, src in pieces:
        np.copyto(dst, src)


def _copy_rounds(pairs, heads: list[int], word: np.ndarray, stripe: int, done: list[int]) -> None:
    """One thread of the agent's background copy of a pipelined call: round ``r`` copies stripe
    ``stripe`` (of ``len(done)``) of the ``r``-th share of every object's bytes after its
    header; ``word`` says the least round every stripe has done. Stripes, not one thread: one
    thread's memcpy ran at ~5 GB/s on the H100's host, and the cold 8K transfer through the
    agent took 0.217 s against 0.068 s for the machine-local client (0.070 s on the H200 when
    the agent still copied with :data:`COPY_THREADS` threads before answering)."""
    stripes = len(done)
    for r in range(1, ROUNDS + 1):
        for (dst, src), head in zip(pairs, heads, strict=True):
            step = -(-(src.nbytes - head) // ROUNDS)
            a, b = head + (r - 1) * step, min(src.nbytes, head + r * step)
            part = -(-(b - a) // stripes) if b > a else 0
            x, y = a + stripe * part, min(b, a + (stripe + 1) * part)
            if x < y:
                np.copyto(dst[x:y], src[x:y])
        with _FENCE:
            done[stripe] = r
            word[0] = min(done)
