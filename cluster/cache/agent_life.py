r"""The cache agent's life, seen from the vLLM process: start, loss, back-off, reconnect.

:class:`AgentLife` is the part of :class:`cluster.cache.agent_transport.AgentTransport` that keeps
an agent process (:mod:`cluster.cache.agent`) serving it. An agent is started by the transport's
binding to its client (vLLM's start-up waits for it, up to ``start_timeout_s``) and, after one is lost or a
start failed, by the next call or the transport's watcher thread, whichever comes first, once the
back-off is over:

* one TCP connect to the Ray address first (no Ray import); unreachable, it is tried again
  :data:`BACKOFF_S`\ [0] later, and the back-off starts over (so a head restarted on its fixed
  address, ``kvblend server --port``, is found within a second, issue 35);
* an agent that starts and fails (no shards, authentication, ...: a process each time) doubles
  the back-off, :data:`BACKOFF_S` (1 s to 30 s); so does every agent lost within
  :data:`HEALTHY_S` of its start, and one that served longer starts it over;
* a background start lets its agent wait up to :data:`SHARDS_WAIT_S` for shards to be
  registered (a restarted head answers before ``kvblend server`` has created them again).

One log line per state change (up, down). The mixin keeps its own state (set by
:meth:`AgentLife._start_life`) and uses the transport's ``config``, ``namespace``, ``arenas``
(the arena), ``_count``, ``_lock``, ``io_timeout_s``, ``stuck_after_s`` and ``arena_bytes``;
the transport's ``close`` sets ``_closed`` and ``_stop``.
"""

from __future__ import annotations

import logging
import threading
import time

from cluster.cache.connect import ObjectKeyMissing
from cluster.cache.wire import MAX_BUFFER_BYTES, AgentLink, spawn_agent

log = logging.getLogger("kvblend.client")

#: seconds the first agent may take to import Ray, join the cluster and find shards
AGENT_START_TIMEOUT_S = 60.0
#: largest chunk object accepted from the agent (the wire's buffer limit for this link)
MAX_OBJECT_BYTES = MAX_BUFFER_BYTES
#: reconnect back-off after a failed start or a lost agent: first and largest, seconds
BACKOFF_S = (1.0, 30.0)
#: seconds an agent must have served for its loss to start the back-off over
HEALTHY_S = 60.0
#: seconds a background start's agent waits for shards (a restarted head answers before them)
SHARDS_WAIT_S = 15.0


class AgentLife:
    """Start, loss and reconnection of the agent (see the module docstring); mixed into
    :class:`~cluster.cache.agent_transport.AgentTransport`."""

    def _start_life(self, start_timeout_s: float) -> None:
        """Start the first agent (waiting up to ``start_timeout_s``), then the watcher thread.
        Called once, when the transport is bound to its client.

        Raises:
            ObjectKeyMissing: the first agent found that the cluster signs its chunk objects and
                this process has no key (issue 37: the vLLM process refuses to start).
        """
        self._link: AgentLink | None = None
        self._starting = self._closed = False
        self._state = ""
        self._backoff, self._next_start, self._link_since = BACKOFF_S[0], 0.0, 0.0
        self._stop = threading.Event()
        why = self._start(start_timeout_s)
        if why is not None and why.startswith(ObjectKeyMissing.__name__ + ": "):
            self.close()  # issue 37: the cluster signs its objects and this process has no key
            raise ObjectKeyMissing(why.split(": ", 1)[1])
        threading.Thread(target=self._watch, name="kvblend-agent-watch", daemon=True).start()

    @property
    def up(self) -> bool:
        """Whether an agent serves now (asked before each call: a lost one is noticed here, and
        while none serves — counted ``agent_down_calls`` — one is started in the background
        once the back-off is over)."""
        return self._agent() is not None

    def _address(self) -> str | None:
        from cluster.cache.connect import _auto_address, _probe

        address = self.config.cluster.ray_address
        if address == "auto":
            address = _auto_address()
        return address if address and _probe(address) else None

    def _start(self, timeout_s: float, shards_wait_s: float = 0.0) -> str | None:
        """Start an agent and wait for its hello answer (up to ``timeout_s``; the agent waits up
        to ``shards_wait_s`` of it for shards to be registered); on failure schedule the next
        attempt (see the module docstring) and return why (None: started). Never raises."""
        why, link, reachable = None, None, True
        try:
            if self._address() is None:
                reachable = False
                why = f"Ray is not reachable at ray_address={self.config.cluster.ray_address!r}"
            else:
                link, why = self._spawn(timeout_s, shards_wait_s)
        except Exception as e:  # noqa: BLE001 - a failed start is a fallback, never an error
            why = f"{type(e).__name__}: {e}"
        with self._lock:
            self._starting = False
            started = link is not None and not self._closed
            if started:
                self._link, self._link_since = link, time.monotonic()
            elif not reachable:
                # one TCP connect per BACKOFF_S[0] costs nothing: a head back on its address is
                # found within a second of the next call, and the back-off starts over
                self._next_start = time.monotonic() + BACKOFF_S[0]
                self._backoff = BACKOFF_S[0]
            else:  # an agent started and failed (no shards, auth, ...): a process each time
                self._next_start = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, BACKOFF_S[1])
        if started:
            self._count("agent_starts", 1)
        if link is not None and self._closed:
            link.close()
        elif link is not None:
            self._state_change("up", f"cache agent up (pid {link.pid}, {why}); using the shared cache")
            if link.closed:  # lost before it was stored: its close found another link current
                self._lost(link)
        else:
            self._state_change("down", f"no cache agent ({why}); serving without the shared cache, "
                               "retrying in the background")
            return why
        return None

    def _state_change(self, state: str, message: str) -> None:
        """Log ``message`` once per change of state (up/down), at debug level otherwise."""
        with self._lock:
            changed, self._state = self._state != state, state
        if changed:
            log.warning("kvblend: %s", message)
        else:
            log.debug("%s", message)

    def _spawn(self, timeout_s: float, shards_wait_s: float) -> tuple[AgentLink | None, str]:
        hello = {"op": "hello", "config": self.config.as_flat_dict(), "namespace": self.namespace,
                 "shards_wait_s": shards_wait_s}
        arena = self.arenas.new_arena(self.arena_bytes)  # each agent a fresh one
        if arena is not None:
            hello["arena"] = {"fd": arena.fd, "bytes": arena.nbytes}
        try:
            link, why = spawn_agent(hello, self._lost, start_timeout_s=timeout_s, io_timeout_s=self.io_timeout_s,
                                    stuck_after_s=self.stuck_after_s, max_buffer_bytes=MAX_OBJECT_BYTES,
                                    pass_fds=() if arena is None else (arena.fd,))
        finally:
            if arena is not None:
                arena.close_fd()  # the agent holds its own descriptor now
        if link is None or not link.arena:
            self.arenas.retire()  # no agent, or it could not map the arena: none held meanwhile
        return link, why

    def _lost(self, link: AgentLink) -> None:
        with self._lock:
            if self._link is not link:
                return
            self._link = None
            if time.monotonic() - self._link_since >= HEALTHY_S:
                self._backoff = BACKOFF_S[0]
            self._next_start = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_S[1])
        self._count("agent_exits", 1)
        self.arenas.retire()  # its arena too: a late write of the dying agent lands nowhere in use
        if not self._closed:
            self._state_change("down", f"cache agent (pid {link.pid}) exited ({link.why_closed}); serving "
                               "without the shared cache (full prefill) and reconnecting in the background")

    def _watch(self) -> None:
        """Reconnect without waiting for a call: every BACKOFF_S[0] s while no agent serves,
        start one once its back-off is over, so the first request after a head is back hits."""
        while not self._stop.wait(BACKOFF_S[0]):
            link = self._link
            if link is not None and link.closed:
                self._lost(link)
            with self._lock:
                start = self._link is None and not self._starting and time.monotonic() >= self._next_start
                self._starting = self._starting or start
            if start:
                self._start(AGENT_START_TIMEOUT_S + SHARDS_WAIT_S, SHARDS_WAIT_S)

    def _agent(self) -> AgentLink | None:
        """The live agent, or None (then maybe start one in the background)."""
        link = self._link
        if link is not None and not link.closed:
            return link
        if link is not None:
            self._lost(link)
        with self._lock:
            start = not self._starting and not self._closed and time.monotonic() >= self._next_start
            if start:
                self._starting = True
        self._count("agent_down_calls", 1)
        if start:
            threading.Thread(target=self._start, args=(AGENT_START_TIMEOUT_S + SHARDS_WAIT_S, SHARDS_WAIT_S),
                             name="kvblend-agent-start", daemon=True).start()
        return None
