"""The connector's scheduler half: which prompt tokens the cache produces, and what to store.

Runs in vLLM's scheduler (the engine-core process, on its busy-loop thread). Per request::

    | BOS sys | sep | chunk A | sep | chunk B | sep | query |
    0                                              blend_end   T
    [ vLLM prefix cache ][ claimed: blended by us, written into paged KV ][ ^ query ]

* **Blend path** (the prompt has separator-delimited chunks): segments are found on the token
  ids (:func:`blend.segments.find_segments`; in a chat prompt the template's text around
  messages bounds segments too, :func:`blend.chat.chat_frames`); the first segment (after a BOS the tokenizer
  adds) is a chunk too (:func:`blend.segments.first_segment_as_chunk`: with nothing before it,
  its KV is a standalone chunk's, so a passage in first position is reused elsewhere and a
  cached chunk can stand first); one batched lookup plans the blend
  (:func:`blend.planner.make_plan`; the client starts prefetching the hits), and when the plan
  blends the half claims tokens ``[num_computed_tokens, blend_end)``; chunk segments the cache
  misses are scheduled for storing (their canonical KV is computed by the worker later; a
  missed first segment starting at token 0 of a prompt nothing is claimed of is gathered from
  the paged cache instead).
* **Prefix path** (no separators, or tensor parallelism): chunks of ``chunk_size`` tokens keyed
  by :func:`tiers.keys.prefix_keys`; the leading cached ones are claimed (never the last prompt
  token: vLLM always computes >= 1), the rest stored after the forward that computes them.
* **Standalone chunks** (LMCache's recipes precompute a passage by sending it alone, or as
  ``system ⟨sep⟩ passage``; :func:`blend.segments.standalone_chunk_spans`): a prompt without separators is also
  stored as one segment (its ids without the BOS the tokenizer added), and so is the last
  segment of a prompt with one separator and no chunk; gathered from the paged cache when it
  starts at token 0, else computed canonically by the worker.

Each key is scheduled for storing once per process (:meth:`KVBlendScheduler._new_store_keys`,
bounded). ``build_connector_meta`` turns the claims into :class:`~cluster.vllm.metadata.LoadSpec`
(slot mapping over the request's blocks) and the pending stores into
:class:`~cluster.vllm.metadata.StoreSpec`; ``request_finished`` holds a request's blocks while
its canonical segments are still to be stored.

Nothing here touches tensors except the slot mappings; the half is built from plain arguments,
so tests drive it with a fake ``Request`` and ``KVCacheBlocks`` and no engine.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from blend.chat import chat_frames
from blend.plan import CHUNK, BlendPlan
from blend.planner import make_plan
from blend.segments import (
    find_segments,
    first_segment_as_chunk,
    special_tokens_around,
    standalone_chunk_spans,
)
from cluster.vllm import compat, paged
from cluster.vllm.costs import CostEstimator, plan_with_costs
from cluster.vllm.events import EventLog, WarnOnce
from cluster.vllm.metadata import KVBlendConnectorMetadata, LoadSpec, StoreSpec
from cluster.vllm.metrics import Counters
from cluster.vllm.options import request_blend_config, request_params
from cluster.vllm.tenant import prefix_only, request_tenant
from tiers.keys import ChunkKey, prefix_keys, segment_key

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: keys remembered as "scheduled for storing" (oldest forgotten first).
_DEDUP_KEYS = 100_000


@dataclass
class _ReqState:
    """Scheduler-side state of one request between lookup and scheduling."""

    token_ids: tuple[int, ...]
    plan: BlendPlan | None = None
    prefix_hits: list[ChunkKey] = field(default_factory=list)  # leading cached prefix chunks
    prefix_tiers: list[str] = field(default_factory=list)      # tier that answered each of them
    claim_start: int = 0
    claim_end: int = 0
    store_segments: list[tuple[ChunkKey, tuple[int, ...]]] = field(default_factory=list)
    store_prefix: list[tuple[ChunkKey, int, int]] = field(default_factory=list)  # gathered after the forward
    block_ids: list[int] = field(default_factory=list)
    num_standalone: int = 0     # stores of standalone_chunk_spans (in the two lists above)
    loaded: bool = False
    load_async: bool = False    # the claim goes through vLLM's async-load path
    store_sent: bool = False    # canonical segments sent to the worker: hold blocks until stored


def _count_tiers(segments) -> dict[str, int]:
    """Hit segments per tier that answered the lookup (``host``, ``disk``, ...)."""
    out: dict[str, int] = {}
    for seg in segments:
        out[seg.tier or "unknown"] = out.get(seg.tier or "unknown", 0) + 1
    return out


class KVBlendScheduler:
    """The scheduler half of :class:`cluster.vllm.connector.KVBlendConnector`.

    Args:
        config: the effective :class:`cluster.config.KVBlendConfig` (``blend``,
            ``cluster.engine_type``/``store_kv``, ``tiers.chunk_size`` are read).
        client: the cache client (``lookup``), a :class:`cluster.vllm.tp_lookup.AllRanksLookup`
            under TP.
        namespace_digest: the chunk namespace of this model and dtype (rank 0's under TP).
        block_size: vLLM's KV block size in tokens.
        load_tokenizer: returns the model's HF tokenizer; called on the first lookup.
        tp_size: tensor-parallel size (> 1: prefix path only).
        load_async: default of ``kvblend_load_async`` (blends on vLLM's async-load path).
        allow_request_overrides: honour the restricted request keys
            (:data:`cluster.vllm.options.RESTRICTED_PARAMS`).
        events, counters, warn: where decisions are reported (see :mod:`cluster.vllm.events`,
            :mod:`cluster.vllm.metrics`).
    """

    def __init__(self, config, client, *, namespace_digest: str, block_size: int,
                 load_tokenizer: Callable[[], Any], tp_size: int = 1, load_async: bool = True,
                 allow_request_overrides: bool = False, events: EventLog | None = None, counters: Counters | None = None,
                 warn: WarnOnce | None = None, costs: CostEstimator | None = None, kv_bytes_per_token: int = 0,
                 num_layers: int = 0) -> None:
        self.config = config
        self.client = client
        self.namespace_digest = namespace_digest
        self.block_size = block_size
        self.tp_size = tp_size
        self.load_async = load_async
        self.allow_request_overrides = allow_request_overrides
        self._load_tokenizer = load_tokenizer
        self._tokenizer = None
        self._events = events if events is not None else EventLog(None)
        self._counters = counters if counters is not None else Counters()
        self._warn = warn if warn is not None else WarnOnce()
        self._requests: dict[str, _ReqState] = {}
        self._store_keys: OrderedDict[ChunkKey, None] = OrderedDict()
        self._async_ready: list[str] = []    # async claims allocated, not yet sent
        self._found_spans: dict[str, tuple[tuple[int, ...], list]] = {}  # may_load_async's, until the lookup
        self._plan_started = 0.0              # perf_counter() at the current plan's start
        #: the cost-aware choice (issue 34): estimates, and the model's KV bytes per token and layers
        self.costs, self._kv_bytes_per_token, self._num_layers = costs, kv_bytes_per_token, num_layers

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    # ------------------------------------------------------------------ lookup and claim

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the connector will produce beyond ``num_computed_tokens`` (vLLM's local
        hit), and whether they load asynchronously.

        Blend path: ``blend_end - num_computed_tokens`` when the plan blends; prefix path:
        the cached leading prefix chunks beyond the local hit. Never the last prompt token.
        Any failure here: 0 (vLLM computes the request), logged once, counted.
        """
        try:
            state = self._plan_request(request)
        except Exception as e:  # noqa: BLE001 - the cache never fails a request
            self._warn("lookup", "kvblend: lookup failed (%s: %s); full prefill", type(e).__name__, e)
            self._counters.bump(fallbacks=1)
            self._requests.pop(request.request_id, None)
            return 0, False
        state.loaded = False  # asked again (e.g. resumed after preemption): load again
        claim_end = state.claim_end
        claim = max(0, claim_end - num_computed_tokens)
        state.claim_start = num_computed_tokens if claim else claim_end
        state.load_async = bool(claim and state.plan is not None and state.plan.blend
                                and request_params(request, self._warn, self.allow_request_overrides).get(
                                    "kvblend_load_async", self.load_async))
        self._events.write("claim", request_id=request.request_id, local_computed_tokens=num_computed_tokens,
                           claimed_tokens=claim, claim_end=claim_end, load_async=state.load_async)
        return claim, state.load_async

    def _plan_request(self, request: Request) -> _ReqState:
        """Look the request's segments (or prefix chunks) up once; the same state when asked
        again with the same prompt (vLLM may ask several times)."""
        rid = request.request_id
        token_ids = tuple(request.prompt_token_ids or ())
        old = self._requests.get(rid)
        if old is not None and old.token_ids == token_ids:
            return old  # called again for the same request (side-effect free)
        self._plan_started = time.perf_counter()  # the lookup event's plan_s (TTFT breakdown)
        state = _ReqState(token_ids=token_ids)
        tenant, uncacheable = request_tenant(request)
        if uncacheable is not None:  # its KV depends on more than its token ids: never cached
            self._warn(f"uncacheable:{uncacheable}", "kvblend: requests with %s are neither loaded nor "
                       "stored (full prefill, counted as uncacheable_requests)", uncacheable)
            self._counters.bump(requests=1, uncacheable_requests=1)
            self._events.write("lookup", request_id=rid, path="none", num_tokens=len(token_ids),
                               uncacheable=uncacheable)
            self._requests[rid] = state
            return state
        ignored: list[str] = []
        params = request_params(request, self._warn, self.allow_request_overrides, ignored)
        if ignored:
            self._counters.bump(ignored_overrides=1)
        store = bool(params.get("kvblend_store", True)) and self.config.cluster.store_kv
        # prompt logprobs: vLLM computes the prompt whatever we claim; we only store (not through
        # params: a request override would be ignored while allow_request_overrides is off)
        load = bool(params.get("kvblend_load", True)) and not compat.skips_external_kv(request)
        blend_cfg = request_blend_config(self.config.blend, params)
        spans = self._segment_spans(rid, token_ids)
        blendable = (self.config.cluster.engine_type == "blend" and self.tp_size == 1
                     and not prefix_only(request, self._warn))
        standalone: list[tuple[int, int]] = []  # spans stored as chunks besides the plan's segments
        if blendable and token_ids and self.config.blend.enable_blending:
            specials = special_tokens_around(self.tokenizer)
            standalone = standalone_chunk_spans(spans, token_ids, specials)
            spans = first_segment_as_chunk(spans, token_ids, specials)
        if store and standalone:
            self._store_standalone(state, standalone, tenant)
        if not load and not store:
            # nothing to read or write: no lookup, which would also start the shards'
            # promotions of these chunks into host memory (evicting others) for nothing
            self._events.write("lookup", request_id=rid, path="none", num_tokens=len(token_ids),
                               num_segments=0, num_hit_segments=0,
                               full_prefill_reason="kvblend_load and kvblend_store are off")
        elif blendable and any(kind == CHUNK for kind, _, _ in spans):
            self._plan_blend(rid, state, spans, blend_cfg, tenant, load=load, store=store)
        else:
            self._plan_prefix(rid, state, tenant, load=load, store=store)
        self._counters.bump(requests=1)
        self._requests[rid] = state
        return state

    def _segment_spans(self, rid: str, token_ids: tuple[int, ...]) -> list:
        """The prompt's segments (:func:`blend.segments.find_segments`), taken from
        :meth:`may_load_async` when it found them for this prompt (a prompt is scanned once)."""
        found = self._found_spans.pop(rid, None)
        if found is not None and found[0] == token_ids:
            return found[1]
        # chat prompts: the template's frame around messages bounds segments too (issue 35)
        return find_segments(token_ids, self.tokenizer, self.config.blend.blend_separator,
                             chat_frames(self.tokenizer)) if token_ids else []

    def may_load_async(self, request: Request) -> bool:
        """Whether :meth:`get_num_new_matched_tokens` may answer ``load_kv_async=True`` for
        ``request`` (vLLM 0.34's ``may_load_async``): its blend would take the async path.

        A request already looked up with this prompt is answered from its plan: it blends and
        claims tokens. Before its lookup (vLLM asks first), without I/O: it may blend (the blend
        engine, one rank, blending on, no LoRA adapter, nothing uncacheable, not computed whole
        by vLLM, ``kvblend_load`` on), asks for the async path (``kvblend_load_async``, default
        ``load_async``) and its prompt holds a chunk segment; the segments are kept for its
        lookup. A prompt whose chunks all miss is a false positive.

        Raises:
            ValueError: a malformed request param or token id (the connector answers False).
        """
        params = request_params(request, self._warn, self.allow_request_overrides)
        if (compat.skips_external_kv(request) or not params.get("kvblend_load", True)
                or not params.get("kvblend_load_async", self.load_async)):
            return False
        token_ids = tuple(request.prompt_token_ids or ())
        state = self._requests.get(request.request_id)
        if state is not None and state.token_ids == token_ids:
            return bool(state.plan is not None and state.plan.blend and state.claim_end)
        if not (token_ids and self.config.cluster.engine_type == "blend" and self.tp_size == 1
                and self.config.blend.enable_blending and request_blend_config(self.config.blend, params).enable_blending
                and not prefix_only(request, self._warn) and request_tenant(request)[1] is None):
            return False
        spans = self._segment_spans(request.request_id, token_ids)
        self._found_spans[request.request_id] = (token_ids, spans)
        spans = first_segment_as_chunk(spans, token_ids, special_tokens_around(self.tokenizer))
        return any(kind == CHUNK for kind, _, _ in spans)

    def _plan_blend(self, rid: str, state: _ReqState, spans, blend_cfg, tenant: str, *, load: bool,
                    store: bool) -> None:
        """Blend path: plan (keys of the request's ``tenant``, :mod:`cluster.vllm.tenant`), claim
        ``[.., blend_end)`` when it blends, schedule missed chunk segments (those ending before
        the last prompt token) for storing."""
        token_ids = state.token_ids
        n = len(token_ids)
        path = "none"
        plan = make_plan(token_ids, spans, self.namespace_digest, self.client, blend_cfg, tenant=tenant)
        cost = None
        if plan.blend and load and self.costs is not None and blend_cfg.cost_aware:
            plan, cost, counts = plan_with_costs(plan, self.costs, kv_bytes_per_token=self._kv_bytes_per_token,
                                                 num_layers=self._num_layers)
            self._counters.bump(**counts)
        state.plan = plan
        if plan.blend and load:
            state.claim_end = plan.blend_end
            path = "blend"
        num_store = 0
        if store:
            missed = [s for s in plan.missed_segments if s.end <= n - 1]
            # a missed first segment with nothing before it, in a prompt vLLM computes itself:
            # the KV vLLM writes is its canonical KV, gathered after the forward like a prefix
            # chunk instead of computed again (after a claim, the claimed KV is ours: computed)
            first = [s for s in missed if s.start == 0 and not state.claim_end]
            keep = {k for k, _ in self._new_store_keys([(s.key, ()) for s in first])}
            gathered = [(s.key, 0, s.end) for s in first if s.key in keep]
            computed = self._new_store_keys([(s.key, token_ids[s.start:s.end]) for s in missed if s not in first])
            state.store_prefix += gathered
            state.store_segments += computed
            num_store = len(gathered) + len(computed)
        self._events.write("lookup", request_id=rid, path=path, num_tokens=n,
                           num_segments=len([s for s in plan.segments if s.kind == CHUNK]),
                           num_hit_segments=len(plan.hit_segments),
                           tier_hits=_count_tiers(plan.hit_segments),
                           reusable_tokens=plan.num_reused_tokens, blend_end=plan.blend_end,
                           full_prefill_reason=plan.full_prefill_reason,
                           num_store_segments=num_store, num_standalone_segments=state.num_standalone,
                           plan_s=time.perf_counter() - self._plan_started, cost=cost)

    def _plan_prefix(self, rid: str, state: _ReqState, tenant: str, *, load: bool, store: bool) -> None:
        """Prefix path: claim the leading cached chunks (whole chunks ending before the last
        token, keys of the request's ``tenant``), schedule the chunks after them for storing."""
        token_ids = state.token_ids
        n = len(token_ids)
        path = "none"
        chunk = self.config.tiers.chunk_size
        keys = prefix_keys(self.namespace_digest, token_ids, chunk, tenant)
        metas = self.client.lookup(keys) if keys else []
        hits = 0
        for meta in metas:
            if meta is None:
                break
            hits += 1
        # vLLM computes >= 1 token: load whole chunks ending before the last token.
        hits = min(hits, (n - 1) // chunk) if load else 0
        state.prefix_hits = keys[:hits]
        state.prefix_tiers = [str(getattr(m, "tier", "") or "") for m in metas[:hits]]
        state.claim_end = hits * chunk
        if state.claim_end:
            path = "prefix"
        num_store = 0
        if store:
            todo = self._new_store_keys([(k, ()) for k in keys[hits:]])
            todo_keys = {k for k, _ in todo}
            state.store_prefix += [(k, i * chunk, (i + 1) * chunk) for i, k in enumerate(keys)
                                   if k in todo_keys]
            num_store = len(todo_keys)
        self._events.write("lookup", request_id=rid, path=path, num_tokens=n,
                           num_prefix_chunks=len(keys), num_prefix_hits=hits,
                           num_store_prefix=num_store, num_standalone_segments=state.num_standalone,
                           plan_s=time.perf_counter() - self._plan_started)

    def _store_standalone(self, state: _ReqState, spans: list[tuple[int, int]], tenant: str) -> None:
        """Store spans of a prompt that LMCache's recipes send to precompute a chunk (see
        :func:`blend.segments.standalone_chunk_spans`) under their segment keys: one starting at token 0 is gathered
        from the paged cache after the forward (nothing before it: vLLM's KV is the canonical
        KV), any other is computed canonically by the worker."""
        token_ids = state.token_ids
        for start, end in spans:
            key = segment_key(self.namespace_digest, token_ids[start:end], tenant)
            if start == 0:
                todo = [(k, 0, end) for k, _ in self._new_store_keys([(key, ())])]
                state.store_prefix += todo
            else:
                todo = self._new_store_keys([(key, token_ids[start:end])])
                state.store_segments += todo
            state.num_standalone += len(todo)

    def cache_hits(self, request_id: str) -> tuple[int, list[tuple[int, int, str]]]:
        """``(claim start, [(start, end, tier), ...])``: the cached spans of the request's claim
        (hit chunk segments, or leading prefix chunks) and the tier that answered each lookup
        (:func:`cluster.vllm.compat.cache_hit_sources`).

        Raises:
            KeyError: no lookup state for ``request_id``.
        """
        state = self._requests[request_id]
        if state.plan is not None and state.plan.blend:
            return state.claim_start, [(s.start, s.end, s.tier) for s in state.plan.hit_segments]
        chunk = self.config.tiers.chunk_size
        return state.claim_start, [(i * chunk, (i + 1) * chunk, tier) for i, tier in enumerate(state.prefix_tiers)]

    def forget_stored_keys(self) -> None:
        """Forget which keys were scheduled for storing (``reset_cache`` deleted them)."""
        self._store_keys.clear()

    def _new_store_keys(self, items):
        """Keep the items whose key was never scheduled for storing (dedup, bounded)."""
        out = []
        for key, ids in items:
            if key in self._store_keys:
                self._store_keys.move_to_end(key)
                continue
            self._store_keys[key] = None
            if len(self._store_keys) > _DEDUP_KEYS:
                self._store_keys.popitem(last=False)
            out.append((key, ids))
        return out

    # ------------------------------------------------------------------ blocks and metadata

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Remember the request's blocks; an async claim is queued for the next metadata."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.block_ids = list(blocks.get_block_ids()[0]) if num_external_tokens else state.block_ids
        if num_external_tokens == 0:
            state.claim_start = state.claim_end  # nothing to load (vLLM has it, or no claim)
            state.load_async = False
        elif state.load_async:
            # vLLM parks the request (WAITING_FOR_REMOTE_KVS): it is not in this step's
            # scheduled requests, so build_connector_meta sends its load from here
            self._async_ready.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVBlendConnectorMetadata:
        """This step's loads (async claims allocated since the last step, then new requests
        with a claim) and stores (segments once per request, prefix chunks once computed)."""
        meta = KVBlendConnectorMetadata()
        scheduled = self._scheduled(scheduler_output)
        meta.has_prefill = bool(scheduler_output.scheduled_new_reqs)
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        async_ready, self._async_ready = self._async_ready, []
        for rid in async_ready:
            state = self._requests.get(rid)
            if state is not None and state.load_async and not state.loaded and state.claim_end > state.claim_start:
                state.loaded = True
                meta.loads.append(self._load_spec(rid, state, state.block_ids))
        for rid, block_ids, computed_after, fresh in scheduled:
            state = self._requests.get(rid)
            if state is None:
                continue
            if computed_after <= len(state.token_ids):
                meta.has_prefill = True
            state.block_ids = block_ids
            if fresh and not state.loaded and state.claim_end > state.claim_start:
                state.loaded = True
                meta.loads.append(self._load_spec(rid, state, block_ids))
            store = self._store_spec(rid, state, block_ids, computed_after)
            if store.segments or store.prefix:
                meta.stores.append(store)
        return meta

    def _scheduled(self, scheduler_output: SchedulerOutput) -> list[tuple[str, list[int], int, bool]]:
        """``(request id, block ids, tokens computed after this step, new or resumed)`` of
        every request this step schedules (the blocks of cached requests updated)."""
        scheduled: list[tuple[str, list[int], int, bool]] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            n_sched = scheduler_output.num_scheduled_tokens.get(new_req.req_id, 0)
            scheduled.append((new_req.req_id, list(new_req.block_ids[0]),
                              new_req.num_computed_tokens + n_sched, True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._requests.get(rid)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = rid in compat.resumed_req_ids(cached)
            if new_blocks is not None:
                state.block_ids = list(new_blocks[0]) if resumed else state.block_ids + list(new_blocks[0])
            n_sched = scheduler_output.num_scheduled_tokens.get(rid, 0)
            scheduled.append((rid, state.block_ids, cached.num_computed_tokens[i] + n_sched, resumed))
        return scheduled

    def _store_spec(self, rid: str, state: _ReqState, block_ids: list[int], computed_after: int) -> StoreSpec:
        """The request's canonical segments (the first time) and the prefix chunks this
        step's forward completes (their slots: they are gathered after the forward)."""
        store = StoreSpec(rid)
        if state.store_segments:
            store.segments, state.store_segments = state.store_segments, []
            state.store_sent = True
        ready = [p for p in state.store_prefix if p[2] <= computed_after]
        if ready:
            state.store_prefix = [p for p in state.store_prefix if p[2] > computed_after]
            store.prefix = [(k, paged.slot_mapping_for(block_ids, self.block_size, s, e)) for k, s, e in ready]
        return store

    def _load_spec(self, rid: str, state: _ReqState, block_ids: list[int]) -> LoadSpec:
        slots = paged.slot_mapping_for(block_ids, self.block_size, state.claim_start, state.claim_end)
        chunk = self.config.tiers.chunk_size
        prefix = [(k, i * chunk, (i + 1) * chunk) for i, k in enumerate(state.prefix_hits)]
        self._counters.bump(claimed_tokens=state.claim_end - state.claim_start)
        return LoadSpec(rid, state.claim_start, state.claim_end, slots, list(block_ids), self.block_size,
                        plan=state.plan if state.plan and state.plan.blend else None, prefix=prefix,
                        token_ids=state.token_ids[:state.claim_end], load_async=state.load_async)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks (``True``) of a request whose canonical segments were sent to the
        worker for storing: vLLM keeps stepping until the worker reports it in
        ``finished_sending``, which drains the store queue even when no other request runs."""
        state = self._requests.pop(request.request_id, None)
        self._found_spans.pop(request.request_id, None)
        return bool(state is not None and state.store_sent), None
