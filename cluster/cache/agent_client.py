"""``AgentClient``: the vLLM connector's cache client when Ray must not live in vLLM's process.

A :class:`~cluster.cache.protocol.CacheClientProtocol` whose Ray work runs in a child process
(:mod:`cluster.cache.agent`, the module docstring says why: a Ray driver dies with a lost
head). This process never imports Ray. While the agent is up, calls go over its socket:

=================  ==========================================================================
``lookup``         one round trip; waited for at most the lookup deadline (``lookup_timeout_s``
                   + margin) — a late answer is a miss for every key
``fetch_layers``   the chunk objects come over once per request (``objects``): the agent
                   copies each into a slot of this process's shared-memory arena
                   (:mod:`cluster.cache.arena`; over the socket when there is none), waited
                   for at most ``load_timeout_s`` (the engine's own wait for a layer: a later
                   answer could not be used); then each layer is sliced and copied here (checked
                   here when the object came from Redis or S3: its tag, or XXH3);
                   ``host_layers()`` hands the same objects to a CUDA worker's staging, which
                   registers the arena with CUDA and copies layers from it to the GPU
``put``            the chunk object, encoded here once (the agent forwards it to the owner
                   shard as it is), sent before returning; at most
                   :data:`~cluster.cache.puts.MAX_PENDING_PUT_BYTES` unanswered (the Ray
                   client's own bound; more: the newest put is dropped and counted)
``contains``,      one round trip each, ``call_timeout_s`` (a timeout is a miss / False / 0)
``delete``,
``flush``
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

While the agent is down every call goes to ``fallback`` (the ``local_fallback`` client:
machine-local disk, memory, or nothing), counted in ``agent_down_calls``; how a new agent is
started, and when, is :mod:`cluster.cache.agent_life`'s.
"""

from __future__ import annotations

import logging
import threading
from collections import namedtuple
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from blend.protocols import ChunkMeta, fetch_in_order
from cluster.cache.agent_life import AGENT_START_TIMEOUT_S, AgentLife
from cluster.cache.agent_objects import AgentObjects
from cluster.cache.agent_ops import LookupHit, answer_of, request
from cluster.cache.deadline import lookup_wait_s
from cluster.cache.host_layers import RayHostLayers
from cluster.cache.local import DeferredRead
from cluster.cache.puts import MAX_PENDING_PUT_BYTES
from cluster.cache.wire import AgentLink, link_timeouts
from tiers.codec import encode_kv, object_layer
from tiers.format import FormatError
from tiers.keys import ChunkKey

log = logging.getLogger("kvblend.client")

COUNTERS = ("lookups", "hits", "misses", "read_errors", "timeouts", "agent_errors", "agent_busy",
            "agent_down_calls", "agent_starts", "agent_exits", "puts", "puts_dropped",
            "layer_reads", "layer_misses", "arena_full", "arena_refits")


#: what :class:`RayHostLayers` reads of a mapped chunk: its header
_Entry = namedtuple("_Entry", "header")


class AgentClient(AgentLife):
    """Cache client over a cache agent (see the module docstring), falling back to ``fallback``.

    Args:
        config: a :class:`cluster.config.KVBlendConfig` (the agent gets every field).
        namespace: chunk namespace digest.
        fallback: the client used while no agent is up (any CacheClientProtocol).
        device: device of the tensors ``fetch_layer`` returns.
        thread_initializer: run first in each fetch thread (a vLLM CPU worker's unpinning).
        start_timeout_s: how long the constructor waits for the first agent (vLLM start-up
            waits for the cache once; later starts happen in the background).

    Raises:
        ObjectKeyMissing: the first agent found that the cluster signs its chunk objects and
            this process has no key (issue 37: the vLLM process refuses to start).
    """

    def __init__(self, config, namespace: str | None, fallback, *, device: str | torch.device = "cpu",
                 thread_initializer: Callable[[], None] | None = None,
                 start_timeout_s: float = AGENT_START_TIMEOUT_S) -> None:
        self.config, self.namespace, self.fallback = config, namespace, fallback
        self.device = torch.device(device)
        self.timeout_s = config.cluster.call_timeout_s
        self.lookup_wait_s = lookup_wait_s(config)
        #: the objects call's wait: the engine's own wait for a layer (``load_timeout_s``)
        self.objects_wait_s = config.blend.load_timeout_s
        self.io_timeout_s, self.stuck_after_s = link_timeouts(config)
        self.arena_bytes = int(config.cluster.agent_arena_gib * 2**30)
        #: what host_layers() keeps beyond the request it stages: nothing (self.objects keeps
        #: objects between requests; views kept there too would pin arena slots)
        self.max_mapped_bytes = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()
        #: the chunk objects read from the agent (arena slots or socket buffers), LRU
        self.objects = AgentObjects(self._count)
        self._put_bytes = 0
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvblend-client", initializer=thread_initializer)
        self._start_life(start_timeout_s)

    # -- counters ------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (:class:`RayHostLayers` counts its reads here)."""
        self._count(name, n)

    def _call(self, link: AgentLink, wait_s: float, message: dict, buffers: Sequence = (),
              on_done: Callable[[object], None] | None = None):
        """``(result, buffers)`` of one agent call, or None (counted) on timeout or error.
        ``on_done(future)`` runs once the call is over: answered, failed or refused."""
        try:
            try:
                fut = link.call(message, buffers)
            except BaseException:
                if on_done is not None:
                    on_done(None)
                raise
            if on_done is not None:
                fut.add_done_callback(on_done)
            return fut.result(timeout=wait_s)
        except (TimeoutError, FutureTimeout):  # distinct classes before Python 3.11
            self._count("timeouts")
        except BlockingIOError:
            self._count("agent_busy")
        except Exception as e:  # noqa: BLE001 - the agent's fault is a miss here
            log.debug("agent call %s failed: %r", message.get("op"), e)
            self._count("agent_errors")
        return None

    # -- KVSource ------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        """As :meth:`CacheClient.lookup`, within the lookup deadline."""
        keys = list(keys)
        link = self._agent()
        if link is None:
            return self.fallback.lookup(keys)
        got = self._call(link, self.lookup_wait_s + 0.25, request("lookup", keys))
        answers = got[0] if got is not None and isinstance(got[0], list) else []
        if got is not None and not isinstance(got[0], list):
            self._count("agent_errors")  # a malformed answer: every key a miss
        out: list[ChunkMeta | None] = [None] * len(keys)
        for i, value in enumerate(answers[:len(keys)]):
            hit = None if value is None else LookupHit.from_wire(value)
            if hit is not None:
                out[i] = ChunkMeta(keys[i], hit.num_tokens, hit.positions(), hit.tier)
                self.objects.note_size(keys[i], hit.object_bound)
            elif value is not None:
                self._count("agent_errors")  # a malformed answer: a miss
        hits = sum(m is not None for m in out)
        with self._lock:
            self.counters["lookups"] += len(keys)
            self.counters["hits"] += hits
            self.counters["misses"] += len(keys) - hits
        return out

    def map_for_read(self, keys: list[ChunkKey]) -> tuple[list[_Entry | None], list[tuple | None]]:
        """The objects of ``keys`` (looked up first where unknown, then read from the agent
        where not held already: :class:`~cluster.cache.agent_objects.AgentObjects`): per key
        an entry with its header and ``(array, header, shared)``, or None twice (a miss)."""
        keys = list(keys)
        unknown = [k for k in keys if not self.objects.knows(k)]
        if unknown and self._link is not None and self.objects.arena is not None:
            self.lookup(unknown)  # an arena slot is sized by the lookup's bound
        link = self._link

        def call(message: dict, on_done) -> tuple | None:
            if link is None:
                on_done(None)
                return None
            return self._call(link, self.objects_wait_s, message, on_done=on_done)

        arrays = self.objects.read(keys, call)
        return [None if a is None else _Entry(a[1]) for a in arrays], arrays

    def _fetch(self, keys: list[ChunkKey], layer_idx: int) -> list[torch.Tensor | None]:
        try:
            _, arrays = self.map_for_read(keys)
            out: list[torch.Tensor | None] = []
            for k, a in zip(keys, arrays, strict=True):
                t = None
                if a is not None and layer_idx < a[1].num_layers:
                    arr, header, shared = a
                    try:
                        # the node's host memory checked every layer as it entered; an object
                        # read from Redis or S3 was not: its layer tag (or XXH3) is checked here
                        t = object_layer(header, layer_idx, arr, checked=not shared).to(self.device)
                    except (FormatError, ValueError) as err:
                        log.debug("layer %d of %s rejected: %s", layer_idx, k, err)
                        self._count("read_errors")
                self._count("layer_reads" if t is not None else "layer_misses")
                out.append(t)
            return out
        except Exception as e:  # noqa: BLE001 - a future never carries a cache fault
            log.warning("fetch_layer failed, serving misses: %r", e)
            self._count("layer_misses", len(keys))
            return [None] * len(keys)

    def fetch_layers(self, keys: Sequence[ChunkKey],
                     layer_idxs: Sequence[int]) -> list[Future[list[torch.Tensor | None]]]:
        """Every layer of ``keys`` in order (:func:`blend.protocols.fetch_in_order`); the
        fallback's while the agent is down. Raises ValueError for a negative layer index."""
        if self._agent() is None:  # each layer through fetch_layer when first asked for, as the fallback reads
            keys = list(keys)
            if any(i < 0 for i in layer_idxs):
                raise ValueError(f"layer_idxs {list(layer_idxs)} must be >= 0")
            return [DeferredRead(lambda i=i: self.fetch_layer(keys, i).result()) for i in layer_idxs]
        return fetch_in_order(self._pool.submit, self._fetch, keys, layer_idxs)

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future[list[torch.Tensor | None]]:
        """One layer (see :meth:`fetch_layers`)."""
        if layer_idx < 0:
            raise ValueError(f"layer_idx={layer_idx} must be >= 0")
        if self._link is None:
            return self.fallback.fetch_layer(keys, layer_idx)
        return fetch_in_order(self._pool.submit, self._fetch, keys, [layer_idx])[0]

    def host_layers(self) -> RayHostLayers:
        """The mapped objects as a CUDA worker's staging reads them (misses while down)."""
        return RayHostLayers(self)

    def use_cuda(self) -> None:
        """A CUDA worker stages from this client: arenas are registered with CUDA."""
        self.objects.use_cuda()

    def device_readable(self, arr) -> bool:
        """Whether the copy engine reads ``arr`` (an object of this client) directly."""
        return self.objects.device_readable(arr)

    def shared_tiers(self) -> list:
        """None here: the agent reads Redis/S3 for chunks whose owner shard died."""
        return []

    # -- KVSink and administration -------------------------------------------------------------
    def put(self, key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None) -> None:
        """Encode ``kv`` ``[L, 2, T, H, D]`` into a chunk object and send it to the agent before
        returning (the agent forwards it to its owner shard); dropped and counted beyond
        :data:`~cluster.cache.puts.MAX_PENDING_PUT_BYTES` in flight.

        Raises:
            TypeError: ``key`` is not a :class:`ChunkKey`.
            ValueError: ``kv`` not 5-D with axis 1 of size 2, or an unsupported dtype.
        """
        if not isinstance(key, ChunkKey):
            raise TypeError(f"put expects a ChunkKey, got {type(key).__name__}")
        link = self._agent()
        if link is None:
            self.fallback.put(key, kv, positions)
            return
        if self._put_bytes + kv.numel() * kv.element_size() > MAX_PENDING_PUT_BYTES:
            self._count("puts_dropped")  # over the bound already: not encoded for nothing
            return
        obj = encode_kv(key, kv, positions, compress=False)  # the only encoding before the shard
        with self._lock:
            if self._put_bytes + len(obj) > MAX_PENDING_PUT_BYTES:
                self.counters["puts_dropped"] += 1
                return
            self._put_bytes += len(obj)
            self.counters["puts"] += 1

        def done(_fut=None, n=len(obj)) -> None:
            with self._lock:
                self._put_bytes -= n

        try:
            link.call(request("put", [key]), [obj]).add_done_callback(done)
        except Exception as e:  # noqa: BLE001 - a put that cannot be sent is dropped
            done()
            log.debug("put of %s not sent: %r", key, e)
            self._count("puts_dropped")

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait up to ``timeout_s`` for the agent's pending puts (or the fallback's)."""
        link = self._agent()
        if link is None:
            return self.fallback.flush(timeout_s)
        return bool(self._answer(link, timeout_s + 1.0, "flush", request("flush", timeout_s=timeout_s)))

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is stored (False for all when the agent does not answer)."""
        keys = list(keys)
        link = self._agent()
        if link is None:
            return self.fallback.contains(keys)
        got = self._answer(link, self.timeout_s * 2, "contains", request("contains", keys), len(keys))
        return got if got is not None else [False] * len(keys)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Delete keys (on the shards through the agent, or the fallback's); how many existed."""
        keys = list(keys)
        self.objects.forget(keys)
        link = self._agent()
        if link is None:
            return self.fallback.delete(keys)
        return self._answer(link, self.timeout_s * 2, "delete", request("delete", keys)) or 0

    def clear(self, namespace: str | None = None) -> int:
        """Delete every chunk of ``namespace`` (all when None) on every shard through the agent
        (``reset_cache``, ``kvblend clear``), and from the fallback; how many the shards deleted.

        Returns 0 when the agent does not answer within ``call_timeout_s`` x 10 (counted)."""
        self.objects.forget()
        tier = getattr(self.fallback, "tier", None)  # the machine-local copies, as a shard clears
        if tier is not None and callable(getattr(tier, "keys", None)):
            stale = [k for k in tier.keys() if namespace is None or k.namespace == namespace]
            if stale:
                self.fallback.delete(stale)
        link = self._agent()
        if link is None:
            return 0
        return self._answer(link, self.timeout_s * 10, "clear", request("clear", namespace=namespace)) or 0

    def _answer(self, link: AgentLink, wait_s: float, op: str, message: dict, num_keys: int = 0):
        """The checked result of a ``contains``/``flush``/``delete``/``clear`` call
        (:func:`~cluster.cache.agent_ops.answer_of`), or None: no answer, or a malformed one
        (counted in ``agent_errors``)."""
        got = self._call(link, wait_s, message)
        value = None if got is None else answer_of(op, got[0], num_keys)
        if got is not None and value is None:
            self._count("agent_errors")
        return value

    def stats(self) -> dict:
        """``{'client': this client's counters, 'agent': {...}, 'shards': {...}}``: the agent's
        client statistics when it is up (its counters under ``agent.client``, its heap trims
        under ``agent.heap_trims``, objects from Redis/S3 it refused under
        ``agent.shared_rejected``), the fallback's otherwise."""
        link = self._link
        got = self._call(link, self.timeout_s * 2, request("stats")) if link is not None else None
        inner = got[0] if got is not None else self.fallback.stats()
        with self._lock:
            client = dict(self.counters)
        return {"client": client, "shards": inner.get("shards", {}), "arena": self.objects.stats(),
                "agent": {"up": link is not None, "pid": link.pid if link else None,
                          "client": inner.get("client", {}), "heap_trims": inner.get("heap_trims", 0),
                          "shared_rejected": inner.get("shared_rejected", 0)}}

    def close(self) -> None:
        """Stop the agent and the fetch threads; the fallback is not closed (it is shared)."""
        self._stop.set()
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
        if link is not None:
            link.close()
        self.objects.retire()
        self._pool.shutdown(wait=False, cancel_futures=True)
