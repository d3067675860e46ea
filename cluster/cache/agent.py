"""The cache agent: a child process that is the Ray driver on behalf of a vLLM process.

Why a separate process (issue 18): a Ray driver does not outlive its cluster. When the GCS
stays unreachable for ``gcs_rpc_server_reconnect_timeout_s`` (60 s by default) Ray exits the
driver's process, and when a restarted head answers with a new cluster id the driver aborts
(``WrongClusterID``, checked with Ray 2.60). Inside vLLM either one kills the engine. So
the vLLM connector's :class:`~cluster.cache.agent_client.AgentClient` starts this process,
talks to it over a Unix socket (:mod:`cluster.cache.wire`: JSON plus raw KV buffers, never
pickle), and when it exits — Ray killed it, or it crashed — serves misses (full prefill,
counted) and starts a new one once the head answers again.

Run by :class:`AgentClient` only, as ``python -I -c <boot> <package root> <socket fd>``
(:func:`main`). The first frame is ``{"op": "hello", "config": {field: value}, "namespace":
digest, "io_timeout_s", "shards_wait_s"}``; the answer is ``{"ok": true, "pid", "shards"}``, or
``{"ok": false, "why"}`` and exit (Ray unreachable, or no shards registered within
``shards_wait_s``, at most :data:`SHARDS_WAIT_MAX_S`). Then every request ``{"id", "op", ...}`` gets
one answer ``{"id", "ok", "result"}`` (or ``"error"``), computed on one of :data:`WORKERS`
threads so a slow fetch never delays a lookup, and a heartbeat ``{"beat": n}`` goes out every
:data:`cluster.cache.wire.BEAT_S` (the client takes silence for a stuck agent). End of stream
(the vLLM process exited), a frame the wire refuses, a send that does not finish within
``io_timeout_s`` (the vLLM process stopped reading) or any other failure of the serve loop ends
the agent at once.

Operations (:data:`cluster.cache.agent_ops.OPS` declares each once, with its lane; ``op_<name>``
answers it): ``lookup``, ``objects`` (each object written into the slot of the vLLM process's
arena that the request names, or without an arena sent as a buffer; the agent holds a mapped
one zero-copy from the node's object store and that write is the only copy; one only Redis or
S3 still holds (owner shard dead) is read whole, at most the size its known header gives, and
handed over only when its header and every layer pass their checks, tags included when a key
is set), ``contains``, ``delete``, ``clear`` (a namespace on every shard), ``put`` (one chunk
object encoded in the vLLM process, forwarded to its owner as it came), ``flush``, ``stats``
(the client's statistics, ``heap_trims`` and ``shared_rejected``).

Memory: each ``put`` frame's buffer (a chunk object) (and an ``objects`` answer read from a shared tier rather
than mapped) is a few MiB of heap, freed once answered; glibc keeps such freed blocks (while a
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
from concurrent.futures import ThreadPoolExecutor

from cluster.cache.agent_ops import OPS, LookupHit, ObjectsAnswer
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
    """Serves one vLLM process's cache calls over ``sock`` with a Ray :class:`CacheClient`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self.client = None
        self.heap_trims = 0
        self.shared_rejected = 0  # objects from Redis/S3 refused (over their size, failed checks)
        self.answers_oversized = 0  # objects over what the vLLM side accepts, answered as misses
        self.max_buffer_bytes = MAX_BUFFER_BYTES
        self.max_frame_bytes = MAX_FRAME_BYTES
        self.arena = None  # an ArenaWriter over the vLLM process's shared memory, when it sent one
        self.arena_refused = 0  # slots named outside the arena
        self.heap = HeapTrimmer(on_trim=self._trimmed)
        self._done = threading.Event()
        #: op name -> its handler ``op_<name>(keys, message, buffers) -> (result, buffers)``
        self.handlers = {name: getattr(self, f"op_{name}") for name in OPS}

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
            from cluster.cache.client import CacheClient

            self.client = CacheClient(config, message.get("namespace"))
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
        rid = message.get("id")
        try:
            result, out = self.run(message, buffers)
            reply = {"id": rid, "ok": True, "result": result}
        except Exception as e:  # noqa: BLE001 - the caller counts it and serves a miss
            log.debug("agent op %s failed: %r", message.get("op"), e)
            reply, out = {"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}"}, ()
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
        # free the frame's buffers now (the pool's work item holds the list until this returns)
        buffers.clear()
        del out
        op = OPS.get(message.get("op"))
        if op is not None and op.buffers:
            self.heap.request()

    def run(self, message: dict, buffers: list) -> tuple[object, list]:
        """``(result, answer buffers)`` of one request: its op's handler (:data:`OPS`)."""
        from tiers.keys import ChunkKey

        handler = self.handlers.get(message.get("op"))
        if handler is None:
            raise ValueError(f"unknown agent op {message.get('op')!r}")
        return handler([ChunkKey.parse(k) for k in message.get("keys", ())], message, buffers)

    # -- the operations (cluster.cache.agent_ops.OPS says what each takes and answers) ---------
    def op_lookup(self, keys: list, message: dict, buffers: list) -> tuple[object, list]:
        from tiers.format import positions_to_runs

        metas = self.client.lookup(keys)
        return [None if m is None else LookupHit(m.num_tokens, tuple(map(tuple, positions_to_runs(m.positions))),
                                                 m.tier, object_bound(self.client.header(k))).to_wire()
                for k, m in zip(keys, metas, strict=True)], []

    def op_objects(self, keys: list, message: dict, buffers: list) -> tuple[object, list]:
        if "slots" in message:
            return self.objects_into_arena(keys, message["slots"]).to_wire(), []
        entries, arrays = self.client.map_for_read(keys)
        objects = [None if a is None else a[0] for a in arrays]
        where = [None if o is None else "host" for o in objects]
        total = 0
        for i, (e, obj) in enumerate(zip(entries, objects, strict=True)):
            if e is not None and obj is None:  # owner dead: a shared tier may hold it
                objects[i] = self.shared_object(keys[i], e.header)
                where[i] = None if objects[i] is None else "shared"
            n = 0 if objects[i] is None else memoryview(objects[i]).nbytes
            if n and (n > self.max_buffer_bytes or total + n > self.max_frame_bytes):
                objects[i] = where[i] = None  # the vLLM side would refuse the frame: a miss
                self.answers_oversized += 1
            total += n if objects[i] is not None else 0
        answer = ObjectsAnswer(tuple(where), (None,) * len(where))
        return answer.to_wire(), [o for o in objects if o is not None]

    def op_contains(self, keys: list, message: dict, buffers: list) -> tuple[object, list]:
        return self.client.contains(keys), []

    def op_stats(self, keys: list, message: dict, buffers: list) -> tuple[object, list]:
        return {**self.client.stats(), "heap_trims": self.heap_trims, "shared_rejected": self.shared_rejected,
                "answers_oversized": self.answers_oversized, "arena_refused": self.arena_refused}, []

    def op_put(self, keys: list, message: dict, buffers: list) -> tuple[object, list]:
        """One chunk object, encoded once in vLLM's process, forwarded as it came (the owner
        shard validates it before storing)."""
        if len(keys) != 1 or len(buffers) != 1:
            raise ValueError("a put carries one key and one object")
        self.client.put_object(keys[0], buffers[0])
        return None, []

    def op_flush(self, keys: list, message: dict, buffers: list) -> tuple[object, list]:
        return self.client.flush(float(message["timeout_s"])), []

    def op_delete(self, keys: list, message: dict, buffers: list) -> tuple[object, list]:
        return self.client.delete(keys), []

    def op_clear(self, keys: list, message: dict, buffers: list) -> tuple[object, list]:
        return self.client.clear(message.get("namespace")), []

    def objects_into_arena(self, keys: list, slots: list) -> ObjectsAnswer:
        """Each key's object written into its slot ``[offset, capacity]`` of the arena
        (``refit``: the object is larger than its slot, ``sizes`` says how large; nothing
        written)."""
        if self.arena is None or not isinstance(slots, list) or len(slots) != len(keys):
            raise ValueError("objects into an arena: no arena, or not one slot per key")
        entries, arrays = self.client.map_for_read(keys)
        where: list = [None] * len(keys)
        sizes: list = [None] * len(keys)
        todo: list[tuple[int, str, object]] = []
        for i, (e, a) in enumerate(zip(entries, arrays, strict=True)):
            obj, kind = (a[0], "host") if a is not None else (None, None)
            if obj is None and e is not None:  # owner dead: a shared tier may hold it
                obj, kind = self.shared_object(keys[i], e.header), "shared"
            if obj is None:
                continue
            n, slot = memoryview(obj).nbytes, slots[i]
            if not (isinstance(slot, list) and len(slot) == 2):
                self.arena_refused += 1
            elif isinstance(slot[1], int) and n > slot[1]:
                where[i], sizes[i] = "refit", n
            else:
                todo.append((i, kind, obj))
        good = []
        for i, kind, obj in todo:  # slots outside the arena are refused here, nothing written
            try:
                self.arena.target(slots[i][0], slots[i][1], obj)
                good.append((i, kind, obj))
            except ValueError as err:
                log.debug("arena slot for %s refused: %s", keys[i], err)
                self.arena_refused += 1
        written = self.arena.write_many([(slots[i][0], slots[i][1], obj) for i, _k, obj in good])
        for (i, kind, _obj), n in zip(good, written, strict=True):
            where[i], sizes[i] = kind, n
        return ObjectsAnswer(tuple(where), tuple(sizes))

    def shared_object(self, key, header) -> bytes | None:
        """``key``'s whole object from the first shared tier that holds a valid one: read only
        when it is no longer than ``header`` (the one looked up) says, and checked whole —
        header, and every layer's checksum, or tag when a key is set — before it goes to the
        vLLM process. None otherwise (counted in ``shared_rejected``)."""
        from tiers.format import FormatError
        from tiers.reader import validate_object

        for tier in self.client.shared_tiers():
            obj = tier.get(key, max_bytes=header.total_bytes)
            if obj is None:
                continue
            try:
                validate_object(obj, key)
            except FormatError as err:
                log.debug("object of %s from %s rejected: %s", key, getattr(tier, "name", "?"), err)
                self.shared_rejected += 1
                continue
            self.client.count("direct_reads")
            return obj
        return None



def object_bound(header) -> int:
    """An upper bound of the bytes of ``header``'s chunk object in any encoding (its
    layers raw or lz4): what the vLLM side reserves in its arena (0: unknown)."""
    if header is None:
        return 0
    return max(header.total_bytes, header.header_end + header.num_layers * (header.layer_nbytes + 64))


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
