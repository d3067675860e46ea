"""Fault injectors for the fault tests and ``kvblend bench faults`` (issue #20): a TCP proxy
that passes, black-holes or slows a service's traffic (:class:`TcpProxy`), a frozen process
(:func:`sigstopped`), bad objects in a tier — flipped, truncated, forged to claim huge sizes,
or gone while the shard's index lists them (:func:`corrupt_object`, :func:`remove_object`) —
a full disk (:func:`small_tmpfs`), a stalled disk file (:func:`stalled_file`) and a tier whose
reads trickle at a set bandwidth (:class:`ThrottledTier`). Never on the serving path; each
injector undoes itself on exit, also on an exception, and stops the threads it started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

from tiers.format import PREFIX_BYTES, parse_header, rewrite_header
from tiers.keys import ChunkKey

log = logging.getLogger(__name__)

PASS, BLACKHOLE, SLOW = "pass", "blackhole", "slow"
MODES = (PASS, BLACKHOLE, SLOW)
#: connections a proxy keeps at once; one accepted beyond it is closed at once
MAX_CONNECTIONS = 64
#: bytes one socket read takes; bytes a connection queues per direction in ``slow`` mode
BUF_BYTES, MAX_QUEUED_BYTES = 64 * 1024, 1 << 20
#: seconds between a proxy thread's checks of the mode and of close(); seconds close() waits
#: for the threads; seconds to connect to the upstream service
POLL_S, JOIN_S, CONNECT_S = 0.05, 5.0, 5.0
#: the KV heads a forged ``oversized`` header claims: a layer of over 2 GiB
OVERSIZED_KV_HEADS = 1 << 28
CORRUPTIONS = ("layer", "header", "truncate", "oversized")


class _Link:
    """One proxied connection; ``lost``: bytes were dropped (its stream cannot resume)."""

    def __init__(self, client: socket.socket) -> None:
        self.client, self.upstream, self.lost = client, None, False
        self.closing = threading.Event()

    def shutdown(self, close: bool = False) -> None:
        """End both pumps (a shut-down socket reads as the end of its stream); ``close``: and
        close the sockets (their pumps are done)."""
        self.closing.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError, AttributeError):
                sock.close() if close else sock.shutdown(socket.SHUT_RDWR)


class TcpProxy:
    """A TCP proxy on ``127.0.0.1:<free port>`` (``self.port``) in front of ``(host, port)``.

    Modes (:meth:`set_mode`, any time; open connections follow within :data:`POLL_S`):
    ``pass`` forwards bytes both ways. ``blackhole`` accepts and reads but never forwards nor
    answers (a partition: clients hang until their own timeout, never see a reset); the
    connections that lost bytes or were opened meanwhile are closed when it ends, the others
    forward again. ``slow`` forwards each read ``delay_s`` seconds after it arrived, both
    ways: a request and its answer take ``2 * delay_s`` longer however the bytes are split
    (forwarding reads one after the other made redis-py's five-round-trip hand-shake outlast
    its socket timeout).

    Bounds: ``max_connections`` (one more is closed at once, counted ``refused``),
    :data:`MAX_QUEUED_BYTES` + one read per connection and direction, two threads a connection
    and one accepting, all joined by :meth:`close`. ``stats`` counts connections ``accepted``,
    ``refused``, ``upstream_failed`` and ``bytes_forwarded``, ``bytes_dropped``,
    ``reads_delayed``. Callers: the fault tests and ``kvblend bench faults``, e.g.
    ``with TcpProxy(host, port) as p: tier = RedisTier(p.via(url)); p.set_mode(BLACKHOLE)``.
    Raises ``ValueError`` for an unknown mode, a negative delay or ``max_connections`` < 1.
    """

    def __init__(self, host: str, port: int, *, mode: str = PASS, delay_s: float = 0.0,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections} must be >= 1")
        self.upstream, self.max_connections, self.port = (host, int(port)), max_connections, 0
        self.stats = dict.fromkeys(("accepted", "refused", "upstream_failed", "bytes_forwarded",
                                    "bytes_dropped", "reads_delayed"), 0)
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._links: set[_Link] = set()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self.mode, self.delay_s = PASS, 0.0
        self.set_mode(mode, delay_s)

    def start(self) -> TcpProxy:
        """Listen on a free port of 127.0.0.1 and start accepting."""
        if self._listener is not None:
            raise RuntimeError("proxy already started")
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.settimeout(POLL_S)
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop, "accept")
        return self

    def close(self) -> None:
        """Stop accepting, close every connection and join every thread within :data:`JOIN_S`
        (one still alive then is logged: see :meth:`threads_alive`). Idempotent."""
        self._stop.set()
        deadline = time.monotonic() + JOIN_S
        while True:  # again while threads remain: one accepted or spawned meanwhile is seen
            with self._lock:
                links = list(self._links)
                threads = [t for t in self._threads if t.is_alive()]
            for link in links:
                link.shutdown()
            if not threads or time.monotonic() >= deadline:
                break
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        for link in links:  # also where a thread did not end in time
            link.shutdown(close=True)
        if self._listener is not None:
            self._listener.close()
        if self.threads_alive():
            log.warning("tcp proxy :%d: %d thread(s) alive after close", self.port, self.threads_alive())

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def threads_alive(self) -> int:
        """How many of the threads this proxy started still run."""
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    def set_mode(self, mode: str, delay_s: float | None = None) -> None:
        """Switch to ``mode``; ``delay_s`` (seconds) sets ``slow``'s delay (None: keep it).
        Leaving ``blackhole`` closes the connections that lost bytes before it returns."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: choose one of {', '.join(MODES)}")
        if delay_s is not None and delay_s < 0:
            raise ValueError(f"delay_s={delay_s} must be >= 0")
        self.delay_s = self.delay_s if delay_s is None else float(delay_s)
        self.mode = mode
        if mode != BLACKHOLE:
            with self._lock:
                lost = [link for link in self._links if link.lost]
            for link in lost:
                link.shutdown()

    def via(self, url: str) -> str:
        """``url`` (``redis://[:pw@]host:port/db``, ``http://host:port/...``) with the proxy's
        host and port; user info, path and query kept."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=f"{userinfo}@{netloc}" if userinfo else netloc))

    def _spawn(self, target, name: str, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True,
                             name=f"tcp-proxy-{self.port}-{name}")
        with self._lock:  # started under the lock: close() never lists it before it is alive
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
            t.start()
        return t

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:  # none is added after close() began
                stopping = self._stop.is_set()
                link = _Link(conn) if len(self._links) < self.max_connections else None
                if link is not None and not stopping:
                    self._links.add(link)
                    self.stats["accepted"] += 1
                elif not stopping:
                    self.stats["refused"] += 1
            if stopping:
                conn.close()
                return
            if link is None:
                conn.close()
                continue
            conn.settimeout(POLL_S)  # sends wait at most this long between checks
            self._spawn(self._serve, "link", link)

    def _serve(self, link: _Link) -> None:
        """Connect the upstream (not during a black hole: that link is lost from the start),
        pump both ways until either ends, then close both sockets and forget the link."""
        back = None
        try:
            if self.mode == BLACKHOLE:
                link.lost = True
            else:
                try:
                    link.upstream = socket.create_connection(self.upstream, timeout=CONNECT_S)
                    link.upstream.settimeout(POLL_S)
                except OSError as e:  # the service is down: the client sees its connection end
                    log.debug("tcp proxy :%d: upstream %s: %s", self.port, self.upstream, e)
                    self._count("upstream_failed")
                    return
                back = self._spawn(self._pump, "back", link, link.upstream, link.client)
            self._pump(link, link.client, link.upstream)
        finally:
            link.shutdown()
            if back is not None:
                back.join(JOIN_S)
            link.shutdown(close=True)
            with self._lock:
                self._links.discard(link)

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket | None) -> None:
        """Read ``src`` and forward to ``dst`` as the mode says (``dst`` None: read and drop)
        until either side ends (what is queued is still delivered), the link shuts down or
        close(). Each read is queued with the time it is due: now, or ``delay_s`` later."""
        queue: deque[tuple[float, bytes]] = deque()  # (due, bytes), oldest first
        queued, eof = 0, False
        poller = select.poll()  # no FD_SETSIZE limit, unlike select.select
        poller.register(src, select.POLLIN)
        try:
            while not (link.closing.is_set() or self._stop.is_set()):
                mode = self.mode
                if link.lost and mode != BLACKHOLE:
                    return
                if queue and mode == BLACKHOLE:
                    link.lost = True
                    self._count("bytes_dropped", queued)
                    queue.clear()
                    queued = 0
                while queue and (mode != SLOW or queue[0][0] <= time.monotonic()):
                    view = memoryview(queue[0][1])
                    while view:  # the socket's timeout: a check of closing every POLL_S
                        if link.closing.is_set() or self._stop.is_set():
                            return
                        try:
                            view = view[dst.send(view):]
                        except TimeoutError:
                            continue
                        except OSError:
                            return
                    queued -= len(queue[0][1])
                    self._count("bytes_forwarded", len(queue.popleft()[1]))
                if eof and not queue:
                    return
                wait_s = max(0.0, min(POLL_S, queue[0][0] - time.monotonic()) if queue else POLL_S)
                if eof or queued >= MAX_QUEUED_BYTES:  # deliver before reading more
                    link.closing.wait(wait_s)
                    continue
                try:  # readable: recv does not wait
                    data = src.recv(BUF_BYTES) if poller.poll(int(wait_s * 1000)) else None
                except OSError:
                    return
                if data is None:
                    continue
                if not data:
                    eof = True
                elif self.mode == BLACKHOLE or dst is None:
                    link.lost = True
                    self._count("bytes_dropped", len(data))
                else:
                    slow = self.mode == SLOW
                    self._count("reads_delayed", int(slow))
                    queue.append((time.monotonic() + (self.delay_s if slow else 0.0), data))
                    queued += len(data)
        finally:
            link.closing.set()  # the other direction ends too


@contextlib.contextmanager
def sigstopped(pid: int, wait_s: float = 5.0) -> Iterator[None]:
    """SIGSTOP ``pid`` on enter (then wait up to ``wait_s`` seconds until ``/proc`` shows it
    stopped) and SIGCONT it on exit, also on an exception: a frozen redis-server or shard
    (LMCache PR #5047's fault). Raises ``ProcessLookupError`` when there is no ``pid``."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _state(pid) not in ("T", None):
            time.sleep(0.01)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (``T``: stopped); None where unreadable."""
    with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def corrupted(obj: bytes, how: str) -> bytes:
    """A broken copy of the valid chunk object ``obj``; ``how`` (:data:`CORRUPTIONS`):
    ``layer`` flips a byte of the last layer (the header parses, the layer's checksum fails),
    ``header`` a byte of the header's JSON (its checksum fails), ``truncate`` cuts the object
    in its payloads (the header parses), ``oversized`` forges a header claiming
    :data:`OVERSIZED_KV_HEADS` KV heads (:func:`tiers.format.rewrite_header`). Raises ``ValueError`` for
    another ``how``, :class:`tiers.format.FormatError` when ``obj`` is invalid."""
    header = parse_header(obj)
    data = bytearray(obj)
    if how == "layer":
        last = header.layers[-1]
        data[last.offset + last.stored_len // 2] ^= 0xFF
    elif how == "header":
        data[(PREFIX_BYTES + header.header_end) // 2] ^= 0x01
    elif how == "truncate":
        del data[header.header_end + (len(data) - header.header_end) // 2:]
    elif how == "oversized":
        return rewrite_header(obj, num_kv_heads=OVERSIZED_KV_HEADS)
    else:
        raise ValueError(f"how={how!r}: choose one of {', '.join(CORRUPTIONS)}")
    return bytes(data)


def corrupt_object(tier, key: ChunkKey, how: str) -> bytes:
    """Replace ``key``'s object in ``tier`` by :func:`corrupted` (``how``), unchecked: a
    :class:`tiers.disk.DiskTier` file is rewritten behind the tier's index (which keeps listing
    it); Redis and S3 (first-wins puts) take ``delete`` then ``put``. Returns the bytes now
    stored. Raises ``LookupError`` when ``tier`` lacks ``key``, ``RuntimeError`` when its
    put fails."""
    obj = tier.get(key)
    if obj is None:
        raise LookupError(f"{tier.name} does not hold {key}")
    bad = corrupted(bytes(obj), how)
    path = _disk_file(tier, key)
    if path is not None:
        with open(f"{path}.fault", "wb") as f:
            f.write(bad)
        os.replace(f"{path}.fault", path)
    else:
        tier.delete([key])
        if not tier.put(key, bad):
            raise RuntimeError(f"{tier.name} refused the corrupted object of {key}")
    return bad


def remove_object(tier, key: ChunkKey) -> None:
    """Remove ``key``'s object from ``tier`` while the shard still lists it: a disk file is
    unlinked behind the tier's index; Redis and S3 delete it (a lookup's answer or a client's
    header cache may still name it). Raises ``LookupError`` when ``tier`` lacked ``key``."""
    path = _disk_file(tier, key)
    try:
        if path is not None:
            os.unlink(path)
        elif tier.delete([key]) != 1:
            raise FileNotFoundError(key)
    except FileNotFoundError:
        raise LookupError(f"{tier.name} does not hold {key}") from None


def _disk_file(tier, key: ChunkKey) -> str | None:
    from tiers.disk import DiskTier

    return tier._file(key) if isinstance(tier, DiskTier) else None


@contextlib.contextmanager
def stalled_file(tier, key: ChunkKey) -> Iterator[str]:
    """The disk tier's file of ``key`` replaced by a FIFO: opening it blocks in the kernel,
    where no Python timeout reaches (as a read on a hung mount or a failing device does),
    until the context exits. Then every blocked open is released (the FIFO is opened for
    reading and writing, so it has a writer), the FIFO is unlinked, and what was blocked
    reads nothing: a failed read, and the key's file is gone (a miss). Yields the path.

    Raises:
        ValueError: ``tier`` is not a DiskTier or does not hold ``key``.
    """
    path = _disk_file(tier, key)
    if path is None or not os.path.exists(path):
        raise ValueError(f"{key} has no file in {getattr(tier, 'name', tier)}")
    os.unlink(path)
    os.mkfifo(path)
    try:
        yield path
    finally:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer: blocked opens return
        try:
            os.unlink(path)  # later opens miss (ENOENT) instead of blocking
        finally:
            os.close(fd)


class TmpfsUnavailable(RuntimeError):
    """No tmpfs could be mounted; the message says why (tests skip on it)."""


@contextlib.contextmanager
def small_tmpfs(path: str, size_bytes: int) -> Iterator[str]:
    """Mount a tmpfs of ``size_bytes`` (rounded up to pages) on ``path`` (created if missing)
    for the ``with`` block, then unmount it (lazily if busy); yields ``path``. Writes past the
    size fail with ENOSPC: a full disk for the disk tier. Raises :class:`TmpfsUnavailable`
    when ``mount`` fails or is missing (it needs root, or CAP_SYS_ADMIN in a container)."""
    os.makedirs(path, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={int(size_bytes)},mode=0700", "tmpfs", path]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        res = subprocess.CompletedProcess(cmd, -1, "", str(e))
    if res.returncode != 0:
        raise TmpfsUnavailable(f"{' '.join(cmd)} failed: {(res.stderr or res.stdout).strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)


#: read methods of some tiers (disk, S3, host) that a :class:`ThrottledTier` hides
UNPACED_READS = frozenset({"open_stream", "get_ranges_into", "get_ranges_into_each", "get_ranges_verified"})


class ThrottledTier:
    """A :class:`~tiers.tier.Tier` whose reads (``get``, ``get_ranges``) deliver at most
    ``gbps`` GB/s in all, after ``latency_s`` each: a slow device or a remote store (Redis, S3)
    where neither can run, e.g. ``kvblend bench gpu --placement``'s ``slow`` rows (issue 34).
    Reads are paced by one schedule shared by every thread (a read waits for the bytes queued
    ahead of it), the sleep outside the lock. ``gbps`` may change while reads run (a tier that
    slows down or recovers). Writes and the rest pass through; ``name`` is the tier's own
    unless given. The wrapped tier's faster read paths (:data:`UNPACED_READS`: streams, reads
    into caller buffers, verified views) are hidden, so every reader falls back to a paced
    ``get``, ``get_ranges`` or ``head``, as a Redis tier serves it (found on the H100: the
    staging reader took the disk tier's ``get_ranges_into`` past the throttle, and the ``slow``
    rows of ``bench gpu --placement`` read at the disk's speed)."""

    def __init__(self, tier, gbps: float, latency_s: float = 0.0, name: str | None = None) -> None:
        if not gbps > 0:
            raise ValueError(f"gbps={gbps} must be > 0")
        self.tier, self.gbps, self.latency_s = tier, float(gbps), float(latency_s)
        self.name = name or tier.name
        self._free_at = 0.0
        self._lock = threading.Lock()

    def _pace(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now + self.latency_s, self._free_at) + nbytes / (self.gbps * 1e9)
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)

    def get(self, key):
        obj = self.tier.get(key)
        if obj is not None:
            self._pace(len(obj))
        return obj

    def get_ranges(self, key, ranges):
        got = self.tier.get_ranges(key, ranges)
        if got is not None:
            self._pace(sum(len(b) for b in got))
        return got

    def head(self, key, max_bytes: int):
        got = self.tier.head(key, max_bytes)
        if got is not None:
            self._pace(len(got))
        return got

    def __getattr__(self, name):  # contains, put, delete, stats, keys, close ... of the tier
        if name in UNPACED_READS:
            raise AttributeError(f"{type(self).__name__} hides {name}: reads are paced")
        return getattr(self.tier, name)
