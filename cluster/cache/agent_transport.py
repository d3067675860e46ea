"""``AgentTransport``: the cache reached through a cache agent, when Ray must not live in
vLLM's process.

The :class:`~cluster.cache.ops.Transport` whose Ray work runs in a child process
(:mod:`cluster.cache.agent`, the module docstring says why: a Ray driver dies with a lost
head). This process never imports Ray. While the agent is up, each op of
:data:`cluster.cache.ops.OPS` is one call over its socket, answered by the agent's
:class:`~cluster.cache.ray_transport.RayTransport`:

=================  ==========================================================================
``lookup``         one round trip; waited for at most the lookup deadline (``lookup_timeout_s``
                   + margin) — a late answer is a miss for every key; each header crosses once
                   per client (then the client says it knows it)
``objects``        once per request: the agent copies each object into a slot of this process's
                   shared-memory arena (:mod:`cluster.cache.agent_objects`; over the socket when
                   there is none), waited for at most the client's read deadline
                   (``load_timeout_s``: the engine waits no longer for a layer)
``put``            the chunk object as the client encoded it (the agent forwards it to the owner
                   shard as it is), sent before returning; it settles when the agent's send to
                   the shard settled (so the client's put bound covers the whole way)
``contains``,      one round trip each, ``call_timeout_s`` x 2 (a timeout is a miss / False / 0);
``delete``,        ``clear`` x 10, ``flush`` its own timeout + 1 s
``flush``,
``clear``, ``stats``
=================  ==========================================================================

The link (:class:`~cluster.cache.wire.AgentLink`) bounds every send and every frame's receive
by ``io_timeout_s`` = max(1 s, ``call_timeout_s``), refuses answers over :data:`MAX_OBJECT_BYTES`
a buffer before allocating them (and tells the agent, which answers a larger object as a
miss), and closes when the agent sent nothing — not even its heartbeat — for ``stuck_after_s``
= max(3 s, 2 x ``call_timeout_s``): so an agent that stopped (SIGSTOP), hung as a whole or
blocked sending to this process is found within ``stuck_after_s`` + 0.5 s, killed, and its
calls are misses (one that keeps beating while a call goes unanswered is not: that call is a
miss at its wait). The agent runs the kvblend this process imported, with ``python -I`` (the
working directory never on its ``sys.path``).

While the agent is down the transport is not ``up``: the client's chain serves from the next
transport (:func:`cluster.cache.factory.make_client`: the ``local_fallback`` cache); how a new
agent is started, and when, is :mod:`cluster.cache.agent_life`'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

from cluster.cache.agent_life import AGENT_START_TIMEOUT_S, MAX_OBJECT_BYTES, AgentLife
from cluster.cache.agent_objects import AgentObjects
from cluster.cache.deadline import lookup_wait_s
from cluster.cache.ops import (
    OPS,
    ClearRequest,
    FlushRequest,
    KeysRequest,
    LookupAnswer,
    LookupRequest,
    ObjectsAnswer,
    ObjectsRequest,
    PutRequest,
    StatsRequest,
    request_frame,
)
from cluster.cache.wire import link_timeouts

log = logging.getLogger("kvblend.client")

__all__ = ["AGENT_START_TIMEOUT_S", "MAX_OBJECT_BYTES", "AgentTransport"]


class AgentTransport(AgentLife):
    """The cache through a cache agent (see the module docstring).

    Args:
        config: a :class:`cluster.config.KVBlendConfig` (the agent gets every field).
        namespace: chunk namespace digest.
        start_timeout_s: how long :meth:`bind` (the client's constructor) waits for the first
            agent.

    Raises:
        ObjectKeyMissing: the first agent found that the cluster signs its chunk objects and
            this process has no key (issue 37: the vLLM process refuses to start).
    """

    name = "agent"
    counters = ("timeouts", "agent_errors", "agent_busy", "agent_down_calls", "agent_starts",
                "agent_exits", "put_errors", "arena_full", "arena_refits")
    remote = True
    compress = False
    threaded = True

    def __init__(self, config, namespace: str | None, *,
                 start_timeout_s: float = AGENT_START_TIMEOUT_S) -> None:
        self.config, self.namespace = config, namespace
        self.timeout_s = config.cluster.call_timeout_s
        self.lookup_wait_s = lookup_wait_s(config)
        self.io_timeout_s, self.stuck_after_s = link_timeouts(config)
        self.arena_bytes = int(config.cluster.agent_arena_gib * 2**30)
        self._lock = threading.Lock()
        self._start_timeout_s = start_timeout_s
        self._host = None
        #: the shared-memory arena the agent writes objects into
        self.arenas = AgentObjects(self._count, self._drop_held)

    def bind(self, host) -> None:
        """The client's counters and held objects (dropped to make room in the arena); then the
        first agent is started, waited for up to ``start_timeout_s`` (vLLM's start-up waits for
        the cache once; later starts happen in the background).

        Raises:
            ObjectKeyMissing: as the class says (the client is not made).
        """
        self._host = host
        self._start_life(self._start_timeout_s)

    def _count(self, name: str, n: int = 1) -> None:
        self._host.count(name, n)

    def _drop_held(self) -> None:
        """The arena retired (its agent is gone, or this closes): the client drops every object
        it holds, as before the agent's loss (the objects of a new agent's arena replace them)."""
        host = self._host
        if host is not None:
            host.drop_objects()

    @property
    def keep_bytes(self) -> int:
        return self.arenas.keep_bytes

    def _call(self, op: str, request, wait_s: float, on_done: Callable[[object], None] | None = None):
        """The typed answer of one agent call (and its frame's buffers), or None (counted: a
        timeout, a refused call, an error, a malformed answer). ``on_done(future)`` runs once
        the call is over: answered, failed or refused."""
        link = self._link
        try:
            if link is None:
                raise ConnectionError("no cache agent")
            message, buffers = request_frame(op, request)
            try:
                fut = link.call(message, buffers)
            except BaseException:
                if on_done is not None:
                    on_done(None)
                raise
            if on_done is not None:
                fut.add_done_callback(on_done)
            value, answer_buffers = fut.result(timeout=wait_s)
        except (TimeoutError, FutureTimeout):  # distinct classes before Python 3.11
            self._count("timeouts")
            return None
        except BlockingIOError:
            self._count("agent_busy")
            return None
        except Exception as e:  # noqa: BLE001 - the agent's fault is a miss here
            log.debug("agent call %s failed: %r", op, e)
            self._count("agent_errors")
            return None
        answer = OPS[op].answer(value, answer_buffers, request)
        if answer is None:
            self._count("agent_errors")  # a malformed answer: as no answer
            return None
        return answer, answer_buffers

    def _answer(self, op: str, request, wait_s: float):
        got = self._call(op, request, wait_s)
        return None if got is None else got[0]

    # -- the ops ---------------------------------------------------------------------------------
    def lookup(self, request: LookupRequest) -> LookupAnswer | None:
        return self._answer("lookup", request, self.lookup_wait_s + 0.25)

    def objects(self, request: ObjectsRequest) -> ObjectsAnswer:
        """Into this process's arena (or over the socket); waited for ``request.timeout_s``."""
        def call(sub: ObjectsRequest, on_done):
            return self._call("objects", sub, request.timeout_s, on_done)

        host = self._host
        return self.arenas.read(request, call, host.evict_oldest if host is not None else lambda keep: False)

    def put(self, request: PutRequest, done: Callable[[bool], None]) -> bool:
        """Send the object to the agent now; ``done(stored)`` once the agent's put settled."""
        link = self._link
        if link is None:
            return False
        message, buffers = request_frame("put", request)
        try:
            fut = link.call(message, buffers)
        except Exception as e:  # noqa: BLE001 - a put that cannot be sent is dropped
            log.debug("put of %s not sent: %r", request.key, e)
            return False

        def settled(f) -> None:
            try:
                stored = f.result()[0] is True
            except Exception:  # noqa: BLE001 - the agent went away: lost (a future miss)
                stored = False
            if not stored:
                self._count("put_errors")
            done(stored)

        fut.add_done_callback(settled)
        return True

    def flush(self, request: FlushRequest) -> bool:
        return bool(self._answer("flush", request, request.timeout_s + 1.0))

    def contains(self, request: KeysRequest) -> tuple[bool, ...] | None:
        return self._answer("contains", request, self.timeout_s * 2)

    def delete(self, request: KeysRequest) -> int | None:
        return self._answer("delete", request, self.timeout_s * 2)

    def clear(self, request: ClearRequest) -> int | None:
        """Every shard's ``clear``; None when the agent does not answer within
        ``call_timeout_s`` x 10 (counted)."""
        return self._answer("clear", request, self.timeout_s * 10)

    def stats(self, request: StatsRequest) -> dict:
        """``{'shards': {...}, 'arena': {...}, 'agent': {'up', 'pid', 'transport': the agent's
        own counters (its Ray transport's and heap trims)}}``."""
        link = self._link
        got = self._answer("stats", request, self.timeout_s * 2) if link is not None else None
        inner = got or {}
        return {"shards": inner.get("shards", {}), "arena": self.arenas.stats(),
                "agent": {"up": link is not None, "pid": link.pid if link else None,
                          "transport": inner.get("agent", {})}}

    def use_cuda(self) -> None:
        """A CUDA worker stages from this client: arenas are registered with CUDA."""
        self.arenas.use_cuda()

    def device_readable(self, arr) -> bool:
        """Whether the copy engine reads ``arr`` (an object in this transport's arena) directly."""
        return self.arenas.device_readable(arr)

    def close(self) -> None:
        """Stop the agent; its arena is retired (its memory goes with the last view of it)."""
        self._stop.set()
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
        if link is not None:
            link.close()
        self.arenas.retire()
