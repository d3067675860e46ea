"""Frames between a vLLM process and its cache agent (:mod:`cluster.cache.agent`), and the
link (:class:`AgentLink`) that matches each answer to its call.

One frame is a JSON message plus zero or more binary buffers, over a Unix stream socket::

    <u32 json bytes> <u32 buffer count> <json> ( <u64 buffer bytes> <buffer> )*

Little-endian. JSON carries the operation and small values (keys, positions, counters); the
buffers carry KV bytes unchanged (no pickle anywhere: what crosses the socket is data, never
code). A frame whose sizes exceed the limits below is a protocol error (the link is closed),
never an allocation of what it claims.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

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


class WireError(ConnectionError):
    """The peer closed the socket, or sent a frame that breaks the format or its limits."""


def send_frame(sock: socket.socket, lock: threading.Lock, message: dict,
               buffers: list | tuple = ()) -> None:
    """Send ``message`` (JSON-able) and ``buffers`` (bytes-like) as one frame.

    ``lock`` serialises writers of ``sock``. Raises :class:`WireError` (or ``OSError``)
    when the peer is gone; ``ValueError`` when a limit is exceeded (nothing is sent).
    """
    body = json.dumps(message, separators=(",", ":")).encode()
    views = [memoryview(b).cast("B") for b in buffers]
    if len(body) > MAX_JSON_BYTES or len(views) > MAX_BUFFERS or any(v.nbytes > MAX_BUFFER_BYTES for v in views):
        raise ValueError("frame exceeds the wire limits")
    parts: list = [_PREFIX.pack(len(body), len(views)), body]
    for v in views:
        parts.append(_LEN.pack(v.nbytes))
        parts.append(v)
    with lock:
        for part in parts:
            sock.sendall(part)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError("peer closed the connection")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> tuple[dict, list[bytearray]]:
    """Read one frame: ``(message, buffers)``. Blocks until a whole frame arrived.

    Raises:
        WireError: end of stream, or a frame over the limits or not valid JSON.
    """
    n_json, n_bufs = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if n_json > MAX_JSON_BYTES or n_bufs > MAX_BUFFERS:
        raise WireError(f"frame over the limits ({n_json} JSON bytes, {n_bufs} buffers)")
    try:
        message = json.loads(_recv_exact(sock, n_json))
    except ValueError as e:
        raise WireError(f"frame is not JSON: {e}") from None
    if not isinstance(message, dict):
        raise WireError("frame message is not an object")
    buffers = []
    for _ in range(n_bufs):
        (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
        if size > MAX_BUFFER_BYTES:
            raise WireError(f"buffer of {size} bytes is over the limit")
        buffers.append(_recv_exact(sock, size))
    return message, buffers


class AgentLink:
    """One running agent: its process, socket, reader thread and the calls awaiting answers."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, pid: int,
                 on_close: Callable[[AgentLink], None]) -> None:
        self.proc, self.sock, self.pid = proc, sock, pid
        self.send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._next = 0
        self._closed = False
        self._on_close = on_close
        threading.Thread(target=self._read, name="kvblend-agent-reader", daemon=True).start()

    def call(self, message: dict, buffers: Sequence = ()) -> Future:
        """Send ``message`` and return the future of its answer ``(result, buffers)``; the
        future fails with ``ConnectionError`` when the agent goes away first."""
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
            send_frame(self.sock, self.send_lock, {**message, "id": rid}, buffers)
        except (OSError, ValueError) as e:
            with self._lock:
                self._pending.pop(rid, None)
            if isinstance(e, OSError):
                self.close()
            raise ConnectionError(f"cache agent send failed: {e}") from None
        return fut

    def _read(self) -> None:
        try:
            while True:
                message, buffers = recv_frame(self.sock)
                with self._lock:
                    fut = self._pending.pop(message.get("id"), None)
                if fut is None:
                    continue  # answer of a call whose caller gave up
                if message.get("ok"):
                    fut.set_result((message.get("result"), buffers))
                else:
                    fut.set_exception(RuntimeError(message.get("error", "agent error")))
        except (WireError, OSError):
            pass
        self.close()

    def close(self) -> None:
        """Fail every pending call, stop the agent (SIGKILL after 2 s) and tell the owner."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(ConnectionError("cache agent is gone"))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        threading.Thread(target=self._reap, daemon=True).start()
        self._on_close(self)

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
