"""Frames between a vLLM process and its cache agent (:mod:`cluster.cache.agent`), the link
(:class:`AgentLink`) that matches each answer to its call, and how a link is opened
(:func:`spawn_agent`: the agent process, its hello).

One frame is a JSON message plus zero or more binary buffers, over a Unix stream socket::

    <u32 json bytes> <u32 buffer count> <json> ( <u64 buffer bytes> <buffer> )*

Little-endian. JSON carries the operation and small values (keys, positions, counters); the
buffers carry KV bytes unchanged (no pickle anywhere: what crosses the socket is data, never
code). A frame whose sizes or JSON nesting exceed the limits below is a protocol error (the
link is closed), never an allocation of what it claims.

Deadlines. Both ends give their socket a timeout (:func:`set_io_timeout`, ``io_timeout_s``):
a send that does not finish within it raises :class:`WireError` (the stream is then broken and
the link closes), and so does a frame that stops arriving half-way. Waiting for the *next*
frame is not bounded by it (:class:`Idle` says the socket was quiet): the agent sends a
heartbeat frame every :data:`BEAT_S`, so the vLLM side's :class:`AgentLink` knows an agent that
sent nothing for ``stuck_after_s`` (stopped, hung as a whole, or blocked in its own sends) is
stuck, and closes the link (the agent is killed; its owner restarts one with back-off). Not
found this way: an agent that keeps beating while one of its workers never answers; each such
call ends at its caller's wait (a miss), and past :data:`MAX_IN_FLIGHT` of them calls are
refused (misses) until the agent is lost.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

log = logging.getLogger("kvblend.client")

_PREFIX = struct.Struct("<II")
_LEN = struct.Struct("<Q")
#: largest JSON part of a frame (a lookup answer for thousands of keys is ~1 MB)
MAX_JSON_BYTES = 64 << 20
#: most buffers in one frame (one per chunk of a request)
MAX_BUFFERS = 4096
#: requests in flight to one agent; beyond it a call is refused (``BlockingIOError``)
MAX_IN_FLIGHT = 256
#: largest single buffer (one chunk object: 32 layers x 4K tokens of a 70B model ~ 1.3 GiB)
MAX_BUFFER_BYTES = 4 << 30
#: most bytes of buffers in one frame
MAX_FRAME_BYTES = 8 << 30
#: deepest JSON nesting of a frame (a lookup answer nests 4 deep)
MAX_JSON_DEPTH = 32
#: seconds between two heartbeat frames of the agent (``{"beat": n}``)
BEAT_S = 0.5
#: most bytes handed to one ``send`` call (the send timeout means "no progress for that long")
SEND_SLICE_BYTES = 4 << 20

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


class WireError(ConnectionError):
    """The peer closed the socket, sent a frame that breaks the format or its limits, or a
    send or a frame did not finish within the socket's timeout."""


class Idle(TimeoutError):
    """No byte of a next frame arrived within the socket's timeout (the peer is quiet; not an
    error: the caller decides whether quiet is too long)."""


def set_io_timeout(sock: socket.socket, io_timeout_s: float) -> None:
    """Bound every send and every frame's receive on ``sock`` by ``io_timeout_s`` seconds."""
    if not io_timeout_s > 0:
        raise ValueError(f"io_timeout_s={io_timeout_s} must be > 0")
    sock.settimeout(io_timeout_s)


def check_nesting(body: bytes | bytearray, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`WireError` when the JSON text ``body`` nests deeper than ``max_depth``
    (checked before parsing: ``json.loads`` recurses once per level)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return
    text = np.frombuffer(_STRING.sub(b'""', bytes(body)), dtype=np.uint8)
    depth = 0
    for start in range(0, text.size, 1 << 20):  # 1 MiB windows: a few MiB of scratch at most
        window = text[start:start + (1 << 20)]
        step = np.zeros(window.size, dtype=np.int8)
        step[(window == ord("[")) | (window == ord("{"))] = 1
        step[(window == ord("]")) | (window == ord("}"))] = -1
        levels = np.cumsum(step, dtype=np.int32) + depth
        if int(levels.max()) > max_depth:
            raise WireError(f"frame JSON nests deeper than {max_depth}")
        depth = int(levels[-1])


def send_frame(sock: socket.socket, lock: threading.Lock, message: dict,
               buffers: list | tuple = (), *, lock_timeout_s: float | None = None) -> None:
    """Send ``message`` (JSON-able) and ``buffers`` (bytes-like) as one frame.

    ``lock`` serialises writers of ``sock`` (waited for at most ``lock_timeout_s``; None: as
    long as it takes). The frame goes out by ``send`` calls of at most
    :data:`SEND_SLICE_BYTES`, each waiting at most the socket's timeout (:func:`set_io_timeout`)
    for room: a send fails when no byte went out for that long, however large the frame.

    Raises:
        WireError: the peer is gone, or a slice did not go out in time (part of the frame may
            be sent: close the socket). ``OSError`` likewise.
        BlockingIOError: ``lock`` not had within ``lock_timeout_s`` (nothing was sent).
        ValueError: a limit is exceeded (nothing is sent).
    """
    body = json.dumps(message, separators=(",", ":")).encode()
    views = [memoryview(b).cast("B") for b in buffers]
    if len(body) > MAX_JSON_BYTES or len(views) > MAX_BUFFERS or any(v.nbytes > MAX_BUFFER_BYTES for v in views):
        raise ValueError("frame exceeds the wire limits")
    parts: list = [_PREFIX.pack(len(body), len(views)) + body]  # one send for a frame without buffers
    for v in views:
        parts.append(_LEN.pack(v.nbytes))
        parts.append(v)
    if not lock.acquire(timeout=-1 if lock_timeout_s is None else lock_timeout_s):
        raise BlockingIOError("another send holds the link")
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view.nbytes:  # each send waits at most the timeout for room, then sends some
                view = view[sock.send(view[:SEND_SLICE_BYTES]):]
    except TimeoutError:
        raise WireError(f"send made no progress for {sock.gettimeout()} s") from None
    finally:
        lock.release()


def _recv_exact(sock: socket.socket, n: int, *, first: bool = False,
                progress: Callable[[], None] | None = None) -> bytearray:
    """``n`` bytes; :class:`Idle` when ``first`` and none came within the timeout;
    ``progress()`` after every read that brought bytes."""
    try:
        buf = bytearray(n)
    except MemoryError:
        raise WireError(f"no memory for {n} bytes of a frame") from None
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            if first and got == 0:
                raise Idle() from None
            raise WireError(f"frame stopped arriving ({got} of {n} bytes within {sock.gettimeout()} s)") from None
        if k == 0:
            raise WireError("peer closed the connection")
        got += k
        if progress is not None:
            progress()
    return buf


def recv_frame(sock: socket.socket, *, max_buffer_bytes: int = MAX_BUFFER_BYTES,
               max_frame_bytes: int = MAX_FRAME_BYTES,
               progress: Callable[[], None] | None = None) -> tuple[dict, list[bytearray]]:
    """Read one frame: ``(message, buffers)``, each size checked before it is allocated;
    ``progress()`` whenever bytes of it arrived (a long frame is not a quiet peer).

    Raises:
        Idle: nothing arrived within the socket's timeout (none set: blocks until a frame).
        WireError: end of stream; a frame over the limits (``max_buffer_bytes`` a buffer,
            ``max_frame_bytes`` all of them, :data:`MAX_JSON_DEPTH`), not valid JSON, or
            stopped half-way.
    """
    n_json, n_bufs = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size, first=True, progress=progress))
    if n_json > MAX_JSON_BYTES or n_bufs > MAX_BUFFERS:
        raise WireError(f"frame over the limits ({n_json} JSON bytes, {n_bufs} buffers)")
    body = _recv_exact(sock, n_json, progress=progress)
    check_nesting(body)
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise WireError(f"frame is not JSON: {type(e).__name__}") from None
    if not isinstance(message, dict):
        raise WireError("frame message is not an object")
    buffers = []
    total = 0
    for _ in range(n_bufs):
        (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size, progress=progress))
        total += size
        if size > max_buffer_bytes or total > max_frame_bytes:
            raise WireError(f"buffer of {size} bytes ({total} in the frame) is over the limit")
        buffers.append(_recv_exact(sock, size, progress=progress))
    return message, buffers


class AgentLink:
    """One running agent: its process, socket, reader and watchdog threads, and the calls
    awaiting answers.

    Args:
        proc: the agent process (killed when the link closes).
        sock: the connected socket; given ``io_timeout_s`` (:func:`set_io_timeout`).
        pid: the agent's pid, as it said.
        on_close: called once, with this link, when it closes (from whichever thread closed it).
        io_timeout_s: bound of every send and of each frame's receive.
        stuck_after_s: the link closes when no byte (of answers and heartbeats alike) arrived
            for this long; so a stuck agent is found within ``stuck_after_s`` + :data:`BEAT_S`.
        max_buffer_bytes: largest buffer accepted in an answer.
        clock: monotonic seconds (tests inject one).
    """

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, pid: int,
                 on_close: Callable[[AgentLink], None], *, io_timeout_s: float = 5.0,
                 stuck_after_s: float = 5.0, max_buffer_bytes: int = MAX_BUFFER_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc, self.sock, self.pid = proc, sock, pid
        self.send_lock = threading.Lock()
        self.stuck_after_s = stuck_after_s
        self.max_buffer_bytes = max_buffer_bytes
        self.io_timeout_s = io_timeout_s
        self.why_closed = ""
        self.arena = False  # the agent writes objects into the caller's shared-memory arena
        self._clock = clock
        self.last_frame = clock()  # when bytes last arrived
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._next = 0
        self._closed = False
        self._stop = threading.Event()
        self._on_close = on_close
        set_io_timeout(sock, io_timeout_s)
        threading.Thread(target=self._read, name="kvblend-agent-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="kvblend-agent-watchdog", daemon=True).start()

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, message: dict, buffers: Sequence = ()) -> Future:
        """Send ``message`` and return the future of its answer ``(result, buffers)``; the
        future fails with ``ConnectionError`` when the agent goes away first.

        Raises:
            ConnectionError: the link is closed, or the send failed or made no progress for
                ``io_timeout_s`` (the link is closed then).
            BlockingIOError: :data:`MAX_IN_FLIGHT` calls are waiting already, or another send
                held the link for ``io_timeout_s``.
        """
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise ConnectionError("cache agent is gone")
            if len(self._pending) >= MAX_IN_FLIGHT:
                raise BlockingIOError("too many calls in flight to the cache agent")
            self._next += 1
            rid = self._next
            self._pending[rid] = fut
        try:
            send_frame(self.sock, self.send_lock, {**message, "id": rid}, buffers,
                       lock_timeout_s=self.io_timeout_s)
        except BlockingIOError:  # a send ahead of this one holds the link: this call is a miss
            with self._lock:
                self._pending.pop(rid, None)
            raise
        except (OSError, ValueError) as e:
            with self._lock:
                self._pending.pop(rid, None)
            if isinstance(e, OSError):
                self.close(f"send failed: {e}", kill_now=True)
            raise ConnectionError(f"cache agent send failed: {e}") from None
        return fut

    def _read(self) -> None:
        why = "the agent closed the connection"
        try:
            while not self._closed:
                try:
                    message, buffers = recv_frame(self.sock, max_buffer_bytes=self.max_buffer_bytes,
                                                  progress=self._heard)
                except Idle:
                    continue  # the watchdog judges quiet
                with self._lock:
                    fut = self._pending.pop(message.get("id"), None)
                if fut is None:
                    continue  # a heartbeat, or the answer of a call whose caller gave up
                if message.get("ok"):
                    fut.set_result((message.get("result"), buffers))
                else:
                    fut.set_exception(RuntimeError(message.get("error", "agent error")))
        except (WireError, OSError) as e:
            why = f"{type(e).__name__}: {e}"
        except BaseException as e:  # noqa: BLE001 - whatever ends the reader closes the link
            why = f"reader failed ({type(e).__name__}: {e})"
        self.close(why)

    def _heard(self) -> None:
        self.last_frame = self._clock()

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S):
            quiet = self._clock() - self.last_frame
            if quiet > self.stuck_after_s and not self._bytes_waiting():
                self.close(f"no frame from the agent for {quiet:.1f} s (stuck)", kill_now=True)
                return

    def _bytes_waiting(self) -> bool:
        """Whether the socket holds unread bytes (this process, not the agent, was slow)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(readable)

    def close(self, why: str = "closed by its owner", *, kill_now: bool = False) -> None:
        """Fail every pending call, stop the agent (SIGKILL at once with ``kill_now``: it is
        stuck; else after 2 s, as it exits by itself at the end of its stream) and tell the
        owner."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.why_closed = why
            pending, self._pending = self._pending, {}
        self._stop.set()
        for fut in pending.values():
            fut.set_exception(ConnectionError("cache agent is gone"))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        threading.Thread(target=self._reap, args=(0.0 if kill_now else 2.0,), daemon=True).start()
        self._on_close(self)

    def _reap(self, grace_s: float) -> None:
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


#: the agent's entry point (``python -I -c``): the interpreter's own path, the folder of the
#: kvblend this process imported (argv[1], even when it is the working directory: this process
#: runs that code already), then this process's path (argv[2]; never '' or the working
#: directory), so the kvblend and the libraries it runs are this process's, whatever else the
#: working directory holds
_BOOT = ("import os, sys; here = os.getcwd(); "
         "sys.path += [sys.argv[1]] if sys.argv[1] not in sys.path else []; "
         "sys.path += [p for p in sys.argv[2].split(os.pathsep) if p and p not in sys.path "
         "and os.path.abspath(p) != here]; "
         "from cluster.cache.agent import main; sys.exit(main(sys.argv[3:]))")


def package_root() -> str:
    """The folder holding the ``cluster`` package this process imported (site-packages, or the
    checkout of an editable install): the agent imports kvblend from there only."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def link_timeouts(config) -> tuple[float, float]:
    """``(io_timeout_s, stuck_after_s)`` of an agent link for a :class:`cluster.config.KVBlendConfig`:
    max(1 s, ``call_timeout_s``) and max(3 s, 2 x ``call_timeout_s``), seconds."""
    call_s = config.cluster.call_timeout_s
    return max(1.0, call_s), max(3.0, 2.0 * call_s)


def spawn_agent(hello: dict, on_close: Callable[[AgentLink], None], *, start_timeout_s: float,
                pass_fds: Sequence[int] = (), **link_options) -> tuple[AgentLink | None, str]:
    """Start a cache agent (:mod:`cluster.cache.agent`) on a socketpair, send it ``hello`` and
    wait up to ``start_timeout_s`` for its answer: ``(link, "<n> shard(s)")``, or ``(None,
    why)`` with the process ended. The agent runs ``python -I`` with this process's
    environment; its ``sys.path`` is the interpreter's own, then :func:`package_root` (even
    when that is the working directory) and this process's ``sys.path`` without ``''`` and the
    working directory: the kvblend and libraries this process runs, never another ``cluster/``
    folder where vLLM was started. ``link_options``:
    :class:`AgentLink`'s keywords; ``io_timeout_s`` and the buffer limits also go to the agent
    in ``hello`` (it answers a larger object as a miss rather than send what this side
    refuses). ``pass_fds``: more descriptors the agent inherits (the arena's memfd, named in
    ``hello``); the link's ``arena`` says whether the agent mapped it."""
    path = os.pathsep.join(p for p in sys.path if p)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, package_root(), path, str(child.fileno())],
                                pass_fds=(child.fileno(), *pass_fds), stdin=subprocess.DEVNULL, cwd=os.getcwd())
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    limits = {"io_timeout_s": link_options.get("io_timeout_s", 5.0),
              "max_buffer_bytes": link_options.get("max_buffer_bytes", MAX_BUFFER_BYTES),
              "max_frame_bytes": MAX_FRAME_BYTES}
    try:
        parent.settimeout(start_timeout_s)
        send_frame(parent, threading.Lock(), {**hello, **limits})
        answer, _ = recv_frame(parent)
        if answer.get("ok"):
            link = AgentLink(proc, parent, int(answer["pid"]), on_close, **link_options)
            link.arena = answer.get("arena") is True
            return link, f"{answer.get('shards')} shard(s)"
    except (OSError, WireError, ValueError, KeyError, TypeError) as e:
        proc.kill()
        proc.wait()
        parent.close()
        return None, f"agent did not answer within {start_timeout_s:.0f} s ({type(e).__name__})"
    parent.close()
    try:
        proc.wait(timeout=5.0)  # it exits after saying why
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return None, str(answer.get("why"))
