"""The cache agent: a child process that is the Ray driver on behalf of a vLLM process.

Why a separate process (issue 18): a Ray driver does not outlive its cluster. When the GCS
stays unreachable for ``gcs_rpc_server_reconnect_timeout_s`` (60 s by default) Ray exits the
driver's process, and when a restarted head answers with a new cluster id the driver aborts
(``WrongClusterID``, checked with Ray 2.60). Inside vLLM either one kills the engine. So
the vLLM connector's :class:`~cluster.cache.agent_client.AgentClient` starts this process,
talks to it over a Unix socket (:mod:`cluster.cache.wire`: JSON plus raw KV buffers, never
pickle), and when it exits — Ray killed it, or it crashed — serves misses (full prefill,
counted) and starts a new one once the head answers again.

Run as ``python -m cluster.cache.agent <socket fd>`` by :class:`AgentClient` only. The first
frame is ``{"op": "hello", "config": {field: value}, "namespace": digest}``; the answer is
``{"ok": true, "pid", "shards"}``, or ``{"ok": false, "why"}`` and exit (Ray unreachable, no
shards). Then every request ``{"id", "op", ...}`` gets one answer ``{"id", "ok", "result"}``
(or ``"error"``), computed on one of :data:`WORKERS` threads so a slow fetch never delays a
lookup. End of stream (the vLLM process exited) ends the agent at once.

Operations: ``lookup`` (keys -> ``[num_tokens, position runs, tier]`` or null), ``objects``
(keys -> each mapped chunk object's bytes as a buffer: the agent holds it zero-copy from the
node's object store and the copy into the socket is the only one), ``contains``, ``delete``,
``clear`` (a namespace on every shard), ``put`` (one ``[L, 2, T, H, D]`` tensor as a buffer),
``flush``, ``stats`` (the client's statistics and ``heap_trims``).

Memory: each ``put`` frame's buffer (and an ``objects`` answer read from a shared tier rather
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
from concurrent.futures import ThreadPoolExecutor

from cluster.env import configure_object_auth
from cluster.heap import HeapTrimmer

log = logging.getLogger("kvblend.agent")

#: threads answering requests (lookups, object reads and puts run side by side)
WORKERS = 8
#: operations answered one at a time in arrival order
ORDERED_OPS = frozenset({"put", "flush", "delete", "clear"})
#: operations whose buffers (a stored chunk's KV, objects read from a shared tier) are large
#: heap blocks freed after the answer: a heap trim is asked for after each
BUFFER_OPS = frozenset({"put", "objects"})


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
        self.heap = HeapTrimmer(on_trim=self._trimmed)

    def _trimmed(self, seconds: float) -> None:
        self.heap_trims += 1

    def send(self, message: dict, buffers: list | tuple = ()) -> None:
        from cluster.cache.wire import send_frame

        send_frame(self.sock, self.send_lock, message, buffers)

    def hello(self) -> bool:
        """Read the hello frame, connect to Ray and answer; False when there is nothing to serve."""
        from cluster.cache.connect import connect
        from cluster.cache.lifecycle import shard_names
        from cluster.cache.wire import recv_frame
        from cluster.config import load_config

        message, _ = recv_frame(self.sock)
        if message.get("op") != "hello":
            self.send({"ok": False, "why": "expected hello"})
            return False
        config = load_config(overrides=message["config"], environ={}, overrides_origin="agent")
        try:
            if connect(config.cluster) is None:
                self.send({"ok": False, "why": f"Ray is not reachable at {config.cluster.ray_address!r}"})
                return False
            shards = shard_names(config.cluster.ray_namespace)
            if not shards:
                self.send({"ok": False, "why": f"no cache shards in Ray namespace {config.cluster.ray_namespace!r}"})
                return False
            from cluster.cache.client import CacheClient

            self.client = CacheClient(config, message.get("namespace"))
        except Exception as e:  # noqa: BLE001 - reported to the vLLM process, which falls back
            self.send({"ok": False, "why": f"{type(e).__name__}: {e}"})
            return False
        self.send({"ok": True, "pid": os.getpid(), "shards": len(shards)})
        return True

    def serve(self) -> None:
        """Answer requests until the vLLM process closes the socket."""
        from cluster.cache.wire import WireError, recv_frame

        pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvblend-agent")
        # puts, flushes and deletes keep their order (a flush waits for the puts sent before
        # it); reads run beside them
        ordered = ThreadPoolExecutor(1, thread_name_prefix="kvblend-agent-writes")
        while True:
            try:
                message, buffers = recv_frame(self.sock)
            except (WireError, OSError):
                return
            lane = ordered if message.get("op") in ORDERED_OPS else pool
            lane.submit(self.answer, message, buffers)

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
        except (OSError, ValueError) as e:
            log.debug("agent reply failed: %r", e)
        # free the frame's buffers now (the pool's work item holds the list until this returns)
        buffers.clear()
        del out
        if message.get("op") in BUFFER_OPS:
            self.heap.request()

    def run(self, message: dict, buffers: list) -> tuple[object, list]:
        from tiers.keys import ChunkKey

        op, client = message["op"], self.client
        keys = [ChunkKey.parse(k) for k in message.get("keys", ())]
        if op == "lookup":
            from tiers.format import positions_to_runs

            metas = client.lookup(keys)
            return [None if m is None else [m.num_tokens, positions_to_runs(m.positions), m.tier]
                    for m in metas], []
        if op == "objects":
            entries, arrays = client.map_for_read(keys)
            objects = [None if a is None else a[0] for a in arrays]
            for i, (e, obj) in enumerate(zip(entries, objects, strict=True)):
                # owner dead, a shared tier holds it: the whole object (the caller checks it)
                for tier in client.shared_tiers() if e is not None and obj is None else ():
                    objects[i] = tier.get(keys[i])
                    if objects[i] is not None:
                        client.count("direct_reads")
                        break
            return [o is not None for o in objects], [o for o in objects if o is not None]
        if op == "contains":
            return client.contains(keys), []
        if op == "delete":
            return client.delete(keys), []
        if op == "put":
            import torch

            from tiers.codec import TORCH_DTYPES

            dtype = TORCH_DTYPES[message["dtype"]]
            kv = torch.frombuffer(buffers[0], dtype=torch.uint8).view(dtype).view(message["shape"])
            client.put(keys[0], kv, message.get("positions"))
            return None, []
        if op == "flush":
            return client.flush(float(message["timeout_s"])), []
        if op == "stats":
            return {**client.stats(), "heap_trims": self.heap_trims}, []
        if op == "clear":
            return client.clear(message.get("namespace")), []
        raise ValueError(f"unknown agent op {op!r}")


def main(argv: list[str]) -> int:
    _all_cpus()
    logging.basicConfig(level=os.environ.get("KVBLEND_AGENT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s kvblend-agent %(levelname)s %(message)s")
    configure_object_auth(dict(os.environ))  # the vLLM worker's key: it started us
    sock = socket.socket(fileno=int(argv[0]))
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
