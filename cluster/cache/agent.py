"""The cache agent: a child process that is the Ray driver on behalf of a vLLM process.

Why a separate process (issue 18): a Ray driver does not outlive its cluster. When the GCS
stays unreachable for ``gcs_rpc_server_reconnect_timeout_s`` (60 s by default) Ray exits the
driver's process, and when a restarted head answers with a new cluster id the driver aborts
(``WrongClusterID``, checked with Ray 2.60). Inside vLLM either one kills the engine. So
the vLLM connector's :class:`~cluster.cache.agent_transport.AgentTransport` starts this process,
talks to it over a Unix socket (:mod:`cluster.cache.wire`: JSON plus raw KV buffers, never
pickle), and when it exits — Ray killed it, or it crashed — serves misses (full prefill,
counted) and starts a new one once the head answers again.

Run by :class:`AgentTransport` only, as ``python -I -c <boot> <package root> <socket fd>``
(:func:`main`). The first frame is ``{"op": "hello", "config": {field: value}, "namespace":
digest, "io_timeout_s", "shards_wait_s"}``; the answer is ``{"ok": true, "pid", "shards"}``, or
``{"ok": false, "why"}`` and exit (Ray unreachable, or no shards registered within
``shards_wait_s``, at most :data:`SHARDS_WAIT_MAX_S`). Then every request ``{"id", "op", ...}`` gets
one answer ``{"id", "ok", "result"}`` (or ``"error"``), computed on one of :data:`WORKERS`
threads (its op's lane) so a slow fetch never delays a lookup, and a heartbeat ``{"beat": n}`` goes out every
:data:`cluster.cache.wire.BEAT_S` (the client takes silence for a stuck agent). End of stream
(the vLLM process exited), a frame the wire refuses, a send that does not finish within
``io_timeout_s`` (the vLLM process stopped reading) or any other failure of the serve loop ends
the agent at once.

Operations: :data:`cluster.cache.ops.OPS` declares each once (its request and answer types,
its lane); the agent reads each request with its type's ``from_wire`` and hands it to its
:class:`~cluster.cache.ray_transport.RayTransport` (the one transport to the shards; no client
of its own: the headers, objects and checks are the vLLM process's client's). Two ops do more
here: ``objects`` writes each object the transport maps (zero-copy from the node's object
store) into the slot of the vLLM process's arena that the request names — the only copy — or,
without an arena, sends it as a buffer; ``put`` forwards the chunk object encoded in the vLLM
process as it came, and answers once the shard's put settled (stored or refused).

Memory: each ``put`` frame's buffer (a chunk object) is a few MiB of heap, freed once handed to
Ray; glibc keeps such freed blocks (while a
stopped shard holds puts they pile up), so after answering one of those the agent asks its
:class:`~cluster.heap.HeapTrimmer` to hand freed heap back (at most every 5 s, and once more
when the agent goes idle; :mod:`cluster.heap` has the measurement).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from cluster.cache.ops import OPS, SlotsAnswer
from cluster.cache.wire import (
    BEAT_S,
    MAX_BUFFER_BYTES,
    MAX_FRAME_BYTES,
    Idle,
    WireError,
    recv_frame,
    send_frame,
    set_io_timeout,
)
from cluster.env import configure_object_auth
from cluster.heap import HeapTrimmer

log = logging.getLogger("kvblend.agent")

#: threads answering requests (lookups, object reads and puts run side by side)
WORKERS = 8
#: seconds the agent waits for its hello frame
HELLO_TIMEOUT_S = 60.0
#: the longest wait for shards a hello may ask (``shards_wait_s``) and how often it looks, s
SHARDS_WAIT_MAX_S = 60.0
SHARDS_POLL_S = 0.5


def _all_cpus() -> None:
    """Undo the one-core affinity a vLLM CPU worker passes to its children."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError, ValueError):
        pass


class Agent:
    """Serves one vLLM process's cache ops over ``sock`` with a :class:`RayTransport`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self.transport = None
        #: the agent's own counts: its transport's (shard_errors, put_errors, ...) and the
        #: objects over what the vLLM side accepts, answered as misses (``answers_oversized``)
        self.counters: Counter = Counter()
        self.heap_trims = 0
        self.max_buffer_bytes = MAX_BUFFER_BYTES
        self.max_frame_bytes = MAX_FRAME_BYTES
        self.arena = None  # an ArenaWriter over the vLLM process's shared memory, when it sent one
        self.heap = HeapTrimmer(on_trim=self._trimmed)
        self._done = threading.Event()
        #: op name -> its handler ``(request) -> answer`` (its JSON result and buffers, or a
        #: Future of them): the transport's method of that name, but where this class has its own
        self.handlers = {name: getattr(self, f"op_{name}", None) or self._forward(name) for name in OPS}

    # -- the transport's host: counters, nothing held here -------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def evict_oldest(self, keep) -> bool:
        return False

    def drop_objects(self) -> None:
        """Nothing: the agent holds no object beyond a request."""

    def placement_changed(self, owner) -> None:
        """Nothing: the vLLM process's client learns each key's owner with its next lookup."""

    def _trimmed(self, seconds: float) -> None:
        self.heap_trims += 1

    def send(self, message: dict, buffers: list | tuple = ()) -> None:
        send_frame(self.sock, self.send_lock, message, buffers)

    def broken(self, why: str) -> None:
        """The link cannot carry frames any more (a send failed or timed out): end serving."""
        if not self._done.is_set():
            log.warning("kvblend agent: link to the vLLM process broken (%s); exiting", why)
        self._done.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the serve loop's receive ends at once
        except OSError:
            pass

    def hello(self) -> bool:
        """Read the hello frame, connect to Ray and answer; False when there is nothing to serve."""
        from cluster.cache.connect import connect
        from cluster.cache.lifecycle import shard_names
        from cluster.config import load_config

        try:
            message, _ = recv_frame(self.sock)
        except Idle:
            return False
        if message.get("op") != "hello":
            self.send({"ok": False, "why": "expected hello"})
            return False
        io_timeout_s = message.get("io_timeout_s")
        if isinstance(io_timeout_s, (int, float)) and io_timeout_s > 0:
            set_io_timeout(self.sock, float(io_timeout_s))
        for name in ("max_buffer_bytes", "max_frame_bytes"):  # what the vLLM side accepts
            value = message.get(name)
            if isinstance(value, int) and value > 0:
                setattr(self, name, value)
        self.map_arena(message.get("arena"))
        config = load_config(overrides=message["config"], environ={}, overrides_origin="agent")
        try:
            if connect(config.cluster) is None:
                self.send({"ok": False, "why": f"Ray is not reachable at {config.cluster.ray_address!r}"})
                return False
            shards = shard_names(config.cluster.ray_namespace)
            wait_s = message.get("shards_wait_s")
            deadline = time.monotonic() + (min(float(wait_s), SHARDS_WAIT_MAX_S)
                                           if isinstance(wait_s, (int, float)) and wait_s > 0 else 0.0)
            while not shards and time.monotonic() < deadline:  # a restarted head, shards coming
                time.sleep(SHARDS_POLL_S)
                shards = shard_names(config.cluster.ray_namespace)
            if not shards:
                self.send({"ok": False, "why": f"no cache shards in Ray namespace {config.cluster.ray_namespace!r}"})
                return False
            from cluster.cache.ray_transport import RayTransport

            self.transport = RayTransport(config, max_mapped_bytes=0)  # holds nothing beyond a request
            self.transport.bind(self)
        except Exception as e:  # noqa: BLE001 - reported to the vLLM process, which falls back
            self.send({"ok": False, "why": f"{type(e).__name__}: {e}"})
            return False
        self.send({"ok": True, "pid": os.getpid(), "shards": len(shards), "arena": self.arena is not None})
        return True

    def map_arena(self, arena) -> None:
        """Map the vLLM process's arena (``{"fd", "bytes"}`` of an inherited memfd); without
        one, or when it cannot be mapped, objects go over the socket."""
        if not isinstance(arena, dict):
            return
        from cluster.cache.arena import ArenaWriter

        fd, nbytes = arena.get("fd"), arena.get("bytes")
        try:
            if not (isinstance(fd, int) and isinstance(nbytes, int)):
                raise ValueError(f"arena {arena!r}")
            self.arena = ArenaWriter(fd, nbytes)
        except (OSError, ValueError) as e:
            log.warning("kvblend agent: cannot map the shared-memory arena (%s); objects go over the socket", e)

    def serve(self) -> None:
        """Answer requests until the vLLM process closes the socket, a frame is refused, a
        send fails, or anything else goes wrong in this loop (then the agent exits: its client
        serves misses and starts another)."""
        pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvblend-agent")
        # puts, flushes and deletes keep their order (a flush waits for the puts sent before
        # it); reads run beside them
        ordered = ThreadPoolExecutor(1, thread_name_prefix="kvblend-agent-writes")
        threading.Thread(target=self._beat, name="kvblend-agent-beat", daemon=True).start()
        try:
            while not self._done.is_set():
                try:
                    message, buffers = recv_frame(self.sock)
                except Idle:
                    continue
                op = OPS.get(message.get("op"))
                lane = ordered if op is not None and op.ordered else pool
                lane.submit(self.answer, message, buffers)
        except (WireError, OSError):
            pass
        except BaseException as e:  # noqa: BLE001 - never a silent end: say why, then exit
            log.warning("kvblend agent: serve loop failed (%s: %s); exiting", type(e).__name__, e)
        finally:
            self._done.set()

    def _beat(self) -> None:
        """A heartbeat frame every :data:`BEAT_S` while serving."""
        n = 0
        while not self._done.wait(BEAT_S):
            n += 1
            try:
                self.send({"beat": n})
            except (OSError, ValueError) as e:
                self.broken(f"heartbeat: {type(e).__name__}: {e}")

    def answer(self, message: dict, buffers: list) -> None:
        """Run one request and send its answer (at once, or when a put settles)."""
        rid = message.get("id")
        try:
            got = self.run(message, buffers)
        except Exception as e:  # noqa: BLE001 - the caller counts it and serves a miss
            log.debug("agent op %s failed: %r", message.get("op"), e)
            got = e
        # free the frame's buffers now (the pool's work item holds the list until this returns)
        buffers.clear()
        if isinstance(got, Future):
            got.add_done_callback(lambda f: self._reply(rid, f.result()))
        else:
            self._reply(rid, got)
        del got
        op = OPS.get(message.get("op"))
        if op is not None and op.buffers:
            self.heap.request()

    def _reply(self, rid, got) -> None:
        """Send ``got`` — ``(result, buffers)``, or the exception the request raised."""
        if isinstance(got, Exception):
            reply, out = {"id": rid, "ok": False, "error": f"{type(got).__name__}: {got}"}, ()
        else:
            reply, out = {"id": rid, "ok": True, "result": got[0]}, got[1]
        try:
            self.send(reply, out)
        except OSError as e:
            self.broken(f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - over the limits, not JSON-able: nothing was sent
            log.debug("agent reply failed: %r", e)
            try:
                self.send({"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}"})
            except Exception as e2:  # noqa: BLE001 - the link is no use any more
                self.broken(f"{type(e2).__name__}: {e2}")

    def run(self, message: dict, buffers: list):
        """``(result, answer buffers)`` of one request, or a Future of them: its op's handler.

        Raises:
            ValueError: an op :data:`OPS` does not declare, or a malformed request.
        """
        op = OPS.get(message.get("op"))
        if op is None:
            raise ValueError(f"unknown agent op {message.get('op')!r}")
        return self.handlers[op.name](op.request.from_wire(message, buffers))

    def _forward(self, name: str):
        """The handler of an op the transport answers as it is (a JSON-able result)."""
        def handler(request):
            answer = getattr(self.transport, name)(request)
            return (list(answer) if isinstance(answer, tuple) else answer), []
        return handler

    # -- the ops this side does more for (cluster.cache.ops.OPS says what each takes) -----------
    def op_lookup(self, request):
        return self.transport.lookup(request).to_wire()

    def op_stats(self, request):
        agent = {**self.counters, "heap_trims": self.heap_trims}
        return {**self.transport.stats(request), "agent": agent}, []

    def op_put(self, request) -> Future:
        """One chunk object, encoded once in vLLM's process, forwarded as it came (the owner
        shard validates it before storing); answered once that put settled."""
        answer: Future = Future()
        if not self.transport.put(request, lambda stored: answer.set_result((bool(stored), []))):
            answer.set_result((False, []))
        return answer

    def op_objects(self, request):
        """The mapped objects of the keys: written into their arena slots (``refit``: larger
        than its slot, nothing written; with a progress word, answered once their headers are
        written, the rest copied in the background), or without slots sent as buffers (an
        object over what the vLLM side accepts is answered as a miss)."""
        objects = self.transport.objects(request).objects
        n = len(request.keys)
        where: list = [None] * n
        sizes: list = [None] * n
        if not request.slots:
            out, total = [], 0
            for i, obj in enumerate(objects):
                size = 0 if obj is None else memoryview(obj).nbytes
                if size and (size > self.max_buffer_bytes or total + size > self.max_frame_bytes):
                    self.counters["answers_oversized"] += 1  # the vLLM side would refuse the frame
                elif size:
                    where[i], total = "host", total + size
                    out.append(obj)
            return SlotsAnswer(tuple(where), tuple(sizes)).to_wire()[0], out
        if self.arena is None:
            raise ValueError("objects into an arena: no arena here")
        todo = []
        for i, obj in enumerate(objects):
            if obj is None:
                continue
            offset, capacity = request.slots[i]
            size = memoryview(obj).nbytes
            if size > capacity:
                where[i], sizes[i] = "refit", size
                continue
            try:  # slots outside the arena are refused here, nothing written
                self.arena.target(offset, capacity, obj)
                todo.append(i)
            except ValueError as err:
                log.debug("arena slot for %s refused: %s", request.keys[i], err)
                self.counters["arena_refused"] += 1
        items = [(*request.slots[i], objects[i]) for i in todo]
        written = (self.arena.write_progressively(items, request.progress) if request.progress >= 0
                   else self.arena.write_many(items))
        for i, nbytes in zip(todo, written, strict=True):
            where[i], sizes[i] = "host", nbytes
        return SlotsAnswer(tuple(where), tuple(sizes)).to_wire()[0], []


def main(argv: list[str]) -> int:
    """``argv``: the socket's file descriptor. Never returns (``os._exit``)."""
    _all_cpus()
    logging.basicConfig(level=os.environ.get("KVBLEND_AGENT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s kvblend-agent %(levelname)s %(message)s")
    configure_object_auth(dict(os.environ))  # the vLLM worker's key: it started us
    sock = socket.socket(fileno=int(argv[0]))
    set_io_timeout(sock, HELLO_TIMEOUT_S)
    agent = Agent(sock)
    try:
        if agent.hello():
            agent.serve()
    finally:
        sock.close()
    # not ray.shutdown(): with the head gone it can wait; the vLLM process is not waiting for us
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
