"""``KVBlendConnector``: CacheBlend and chunk storage inside stock vLLM (KV connector API v1).

Load it with ``KVTransferConfig(kv_connector="KVBlendConnector", kv_role="kv_both",
kv_connector_module_path="cluster.connector", kv_connector_extra_config={...})`` or, with
kvblend installed, ``vllm serve MODEL --kv-transfer-config '{"kv_connector":"KVBlendConnector",
"kv_role":"kv_both"}'`` (the ``kvblend`` general plugin registers the short name).

One request's life (``|`` are segment bounds, ``^`` what vLLM computes itself)::

    | BOS sys | sep | chunk A | sep | chunk B | sep | query |
    0                                              blend_end   T
    [ vLLM prefix cache ][ claimed: blended by us, written into paged KV ][ ^ query ]

Scheduler side (``get_num_new_matched_tokens``): segments are found on the token ids
(:func:`blend.segments.find_segments`), one batched lookup (:func:`blend.planner.make_plan`;
the cluster client starts prefetching hits) and, when the plan blends, the connector claims
tokens ``[num_computed_tokens, blend_end)`` (vLLM always computes >= 1 token: the query).
Prompts without separators take the prefix path: chunks of ``chunk_size`` tokens keyed by
:func:`tiers.keys.prefix_keys`, loaded exactly and stored after the forward.
``build_connector_meta`` sends each request's plan and slot mapping to the worker.

Worker side (``start_load_kv``):
:class:`blend.engine.BlendEngine` runs over :class:`blend.adapters.vllm.VLLMModelAdapter`
and :class:`cluster.vllm.worker_source.WorkerKVSource` (the worker's gpu tier of ``gpu_size_gib``
in front of the cache client; the load event's ``gpu_hit_segments`` counts its hits), and each layer's final KV is written at the request's slots by the
attention backend's own ``do_kv_cache_update`` (correct for every paged layout and CPU ISA;
:mod:`cluster.vllm.paged` is the plain-torch reference and the read path). Any failure: the
request's KV is recomputed by full prefill through the same adapter; if even that fails,
its blocks are reported by ``get_block_ids_with_load_errors`` (set vLLM's
``kv_load_failure_policy="recompute"`` so vLLM recomputes them instead of failing the
request). Never partial KV: the last write per layer wins and every claimed slot is written.

Blends take vLLM's **async-load path** (``load_async``, default on): the scheduler answers
``(tokens, True)``, vLLM parks the request in ``WAITING_FOR_REMOTE_KVS`` with its blocks
allocated, and the worker advances the blend a few layers per engine step
(:meth:`blend.engine.BlendEngine.blend_steps`) for about ``load_step_s`` seconds after the
step's forward, so requests already decoding keep getting tokens while a long prompt blends
(the model runs on the worker's own thread only: vLLM's CPU ops are not thread-safe). A step
with nothing else scheduled runs the rest of the blend at once. Done loads are reported in
``get_finished``'s ``finished_recving``; vLLM then schedules the query. A request aborted
mid-load is abandoned and reported the same way (vLLM frees its blocks then).
Prefix loads and ``load_async=False`` stay synchronous (before the forward that computes the
query).

Store side: the canonical (standalone, positions ``0..n-1``) KV of chunk segments not yet
cached is computed with ``engine.prefill`` on the worker's own thread, never concurrently with
vLLM (vLLM's CPU GEMMs share oneDNN scratch memory, so a second thread running the model
corrupts both). It is deduplicated in the scheduler (a key is scheduled once) and in the worker
(``contains`` before computing), queued, and computed in ``wait_for_save`` of *later* steps —
not in the step that computes the request's prefill, so it never delays a first token — at most
``store_tokens_per_step`` tokens per step (a whole segment at least; steps with prefill tokens
skip the queue unless its oldest item waited :data:`STORE_MAX_DEFER_S`). To keep vLLM stepping
until the queue drains, ``request_finished`` holds the request's blocks (returns ``True``) while
its segments are pending, and the worker reports it in ``get_finished``'s ``finished_sending``
once they are done; an idle engine then runs empty steps that only drain the queue. Puts go to
the client from a background I/O thread (no model use). Prefix chunks are gathered from the
paged cache after the forward that computed them and put the same way.

**Reaching the model** (no vLLM source patch): :mod:`cluster.vllm.model_hook` — the kvblend general
plugin registers tracking subclasses of vLLM's model classes; the worker-side connector takes
the model built in its process from :func:`cluster.vllm.model_hook.current_model`.

**Metrics**: our counters (:data:`PROM_COUNTERS`) go through vLLM's connector stats hooks
(``get_kv_connector_stats`` on both sides, ``build_kv_connector_stats``, ``build_prom_metrics``)
to vLLM's ``/metrics`` as ``vllm:kvblend_<name>_total``; vLLM's own
``vllm:external_prefix_cache_hits_total`` counts the tokens the connector claimed.

**Events**: every decision appends one JSON line to ``kv_connector_extra_config["stats_path"]``
when set (``{"event": "lookup"|"load"|"store", "request_id": ..., ...}``; readable by tests and
the demo from the front-end process, across vLLM's engine-core process boundary); cumulative
counters are also in :attr:`KVBlendConnector.counters` and logged at debug level.

Options: our config (YAML/env/LMCache aliases, :func:`cluster.config.load_config`) overridden by
``kv_connector_extra_config`` (our field names; ``stats_path`` is connector-only). Per request,
``SamplingParams(extra_args={"kv_transfer_params": {...}})`` with ``kvblend_load`` (False: load
nothing, vLLM computes the prompt), ``kvblend_blend`` (False: no blending), ``kvblend_recompute_ratio``
(float in [0, 1]), ``kvblend_store`` (False: store nothing), ``kvblend_load_async`` (bool: this
request's blend on the async path or not). Connector-only extra-config keys:
``store_tokens_per_step`` (int, default :data:`STORE_TOKENS_PER_STEP`) bounds the store compute per
engine step; ``load_async`` (bool, default True) and ``load_step_s`` (float seconds, default
:data:`LOAD_STEP_S`) as above.

Tensor parallelism (``tensor_parallel_size`` > 1): prefix reuse only (the vLLM adapter does
not shard the model, so the connector does not blend; a warning says so); each rank stores and
loads its own KV heads under its own namespace, and the scheduler's lookups go through
:class:`AllRanksLookup` (a chunk hits only when every rank stored it).

Client: :func:`make_client` — the Ray-sharded ``CacheClient`` when Ray and shards are reachable,
else one ``LocalCacheClient`` shared by every connector of this process (scheduler and worker
roles live in the same engine-core process on the CPU backend, so they see the same cache).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from blend.plan import CHUNK, BlendPlan
from cluster.vllm import paged
from cluster.vllm.affinity import all_cpus, unpin_thread
from cluster.vllm.events import read_stats, wait_for_stores  # noqa: F401  (re-exported)
from tiers.keys import ChunkKey, prefix_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvblend.connector")

#: kv_connector_extra_config keys that are not config fields.
CONNECTOR_ONLY_KEYS = ("stats_path", "store_tokens_per_step", "load_async", "load_step_s")
#: per-request kv_transfer_params understood by the connector.
REQUEST_PARAMS = ("kvblend_load", "kvblend_blend", "kvblend_recompute_ratio", "kvblend_store",
                  "kvblend_load_async")
_DEDUP_KEYS = 100_000
#: default tokens of canonical-KV compute per engine step (bounds the stall of a decode step).
STORE_TOKENS_PER_STEP = 512
#: a store queued longer than this (seconds) is computed even in a step with prefill tokens.
STORE_MAX_DEFER_S = 2.0
#: default seconds of async blend work per engine step that also runs other requests.
LOAD_STEP_S = 0.1

_local_clients: dict[str, Any] = {}
_local_lock = threading.Lock()


def make_client(config, namespace_digest: str, device: str = "cpu"):
    """The cache client of this process: Ray ``CacheClient`` when reachable, else a
    ``LocalCacheClient`` shared by every connector in this process (one warning, by
    :func:`cluster.cache.factory.make_client`)."""
    from cluster.cache.factory import make_client as ray_make_client
    from cluster.cache.local import LocalCacheClient

    try:
        client = ray_make_client(config, namespace_digest, device=device)
    except Exception as e:  # noqa: BLE001 - no shared cache is a degraded mode, not an error
        log.warning("kvblend: cache client unavailable (%s: %s); using a local cache", type(e).__name__, e)
        client = LocalCacheClient(device=device)
    if isinstance(client, LocalCacheClient):
        with _local_lock:
            client = _local_clients.setdefault(namespace_digest, client)
    return client


class AllRanksLookup:
    """The scheduler's view of the cache under tensor parallelism: each rank stores its own
    KV heads under its own namespace, so a chunk counts as a hit only when every rank's copy
    is stored (the same key in each of ``digests``). ``lookup`` ANDs over the ranks and
    returns the first rank's metadata; everything else goes to ``client``.

    Args:
        client: the cache client (``lookup(keys) -> list[ChunkMeta | None]``).
        digests: namespace digests of ranks ``0..tp_size-1``; the keys asked about are in
            ``digests[0]``.
    """

    def __init__(self, client, digests: list[str]) -> None:
        self.client = client
        self.digests = list(digests)

    def lookup(self, keys: list[ChunkKey]) -> list:
        base = self.client.lookup(keys)
        for digest in self.digests[1:]:
            if not any(m is not None for m in base):
                break
            other = self.client.lookup([dataclasses.replace(k, namespace=digest) for k in keys])
            base = [m if o is not None else None for m, o in zip(base, other, strict=True)]
        return base

    def __getattr__(self, name: str):
        return getattr(self.client, name)


def settle(llm, max_steps: int = 100_000, flush_timeout_s: float = 120.0) -> int:
    """Step an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) until its
    scheduler holds no request, so the connector's queued stores are computed — what vLLM's
    engine-core process does by itself after a request finishes — then wait for their puts
    (the worker's I/O thread), so a following lookup sees the chunks. Returns the steps taken.

    Raises:
        RuntimeError: requests are still held after ``max_steps`` steps, or the puts did not
            finish within ``flush_timeout_s``.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    steps = 0
    while scheduler.has_requests() and steps < max_steps:
        llm.llm_engine.step()
        steps += 1
    if scheduler.has_requests():
        raise RuntimeError(f"the engine still holds requests after {steps} steps")
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    if isinstance(worker, KVBlendConnector) and not worker.flush(timeout_s=flush_timeout_s):
        raise RuntimeError(f"the connector's puts did not finish within {flush_timeout_s} s")
    return steps


# ----------------------------------------------------------------------------- metadata


@dataclass
class LoadSpec:
    """Tokens ``[load_start, load_end)`` of one request to produce into vLLM's paged cache.

    ``plan`` set: blend (the engine computes ``[0, plan.blend_end)`` and only the claimed
    rows are written). ``prefix`` set: exact prefix chunks ``(key, start, end)`` to load.
    """

    request_id: str
    load_start: int
    load_end: int
    slot_mapping: torch.Tensor                  # [load_end - load_start] int64
    block_ids: list[int]
    block_size: int
    plan: BlendPlan | None = None
    prefix: list[tuple[ChunkKey, int, int]] = field(default_factory=list)
    token_ids: tuple[int, ...] = ()             # [0, load_end): for the full-prefill fallback
    load_async: bool = False                    # vLLM's async-load path (see the module docstring)


@dataclass
class StoreSpec:
    """What to store for one request: canonical chunk segments and/or prefix chunks."""

    request_id: str
    segments: list[tuple[ChunkKey, tuple[int, ...]]] = field(default_factory=list)
    prefix: list[tuple[ChunkKey, torch.Tensor]] = field(default_factory=list)  # key, slots [chunk_size]


@dataclass
class KVBlendConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    has_prefill: bool = False   # this step computes prompt tokens (stores wait for a later step)
    idle: bool = False          # nothing scheduled: async loads may run to the end in this step


@dataclass
class _ReqState:
    """Scheduler-side state of one request between lookup and scheduling."""

    token_ids: tuple[int, ...]
    plan: BlendPlan | None = None
    prefix_hits: list[ChunkKey] = field(default_factory=list)  # leading cached prefix chunks
    claim_start: int = 0
    claim_end: int = 0
    store_segments: list[tuple[ChunkKey, tuple[int, ...]]] = field(default_factory=list)
    store_prefix: list[tuple[ChunkKey, int, int]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    loaded: bool = False
    load_async: bool = False    # the claim goes through vLLM's async-load path
    store_sent: bool = False    # canonical segments sent to the worker: hold blocks until stored


@dataclass
class _LoadRun:
    """Worker side: one blend load in flight (async: advanced a slice per engine step)."""

    spec: LoadSpec
    record: dict[str, Any]
    steps: Any                  # BlendEngine.blend_steps generator
    on_layer: Any
    start_s: float
    num_engine_steps: int = 0   # engine steps it ran in
    busy_steps: int = 0         # of those, steps that also ran other requests' forward


@dataclass
class _PendingStore:
    """Worker side: canonical segments of one request still to compute and put."""

    request_id: str
    segments: deque = field(default_factory=deque)   # (ChunkKey, token ids)
    enqueued_s: float = 0.0
    finished: bool = False      # vLLM finished the request (its id came in finished_req_ids)
    stored: int = 0
    skipped: int = 0
    tokens: int = 0
    seconds: float = 0.0
    error: str | None = None


class _Stats:
    """One JSON line per event appended to ``path`` (atomic O_APPEND writes)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields},
                          default=str) + "\n"
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)


def _count_tiers(segments) -> dict[str, int]:
    """Hit segments per tier that answered the lookup (``host``, ``disk``, ...)."""
    out: dict[str, int] = {}
    for seg in segments:
        out[seg.tier or "unknown"] = out.get(seg.tier or "unknown", 0) + 1
    return out




# ----------------------------------------------------------------------------- metrics

#: counter -> help text; exported on vLLM's /metrics as ``vllm:kvblend_<name>`` (Counter,
#: ``_total`` suffix) by :class:`KVBlendPromMetrics`.
PROM_COUNTERS: dict[str, str] = {
    "requests": "requests the connector looked up",
    "blend_requests": "requests blended (CacheBlend path)",
    "prefix_requests": "requests served by exact prefix chunks",
    "segments": "chunk segments of blended requests",
    "hit_segments": "chunk segments read from the cache",
    "gpu_hit_segments": "of those, segments the worker's gpu tier held",
    "claimed_tokens": "prompt tokens the connector produced instead of vLLM",
    "reused_tokens": "tokens whose cached KV was reused",
    "selected_tokens": "reused tokens recomputed (selected at the check layer)",
    "computed_tokens": "tokens computed in every layer (prefix, separators, misses)",
    "load_wait_s": "seconds the blend engine waited for cached KV",
    "fallbacks": "requests computed by full prefill after a cache or blend failure",
    "load_errors": "requests whose KV the connector could not produce (vLLM recomputed them)",
    "stored_chunks": "chunks stored",
    "stored_tokens": "tokens stored",
    "store_skipped": "chunks not stored because already cached",
    "store_s": "seconds spent computing and storing chunks",
}


class KVBlendConnectorStats(KVConnectorStats):
    """Counter deltas (``data``: name -> number, keys of :data:`PROM_COUNTERS`)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVBlendConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVBlendPromMetrics(KVConnectorPromMetrics):
    """Our counters on vLLM's ``/metrics`` (one Counter per :data:`PROM_COUNTERS` entry,
    labelled per engine like vLLM's own)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, doc in PROM_COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:kvblend_{name}", documentation=f"kvblend: {doc}",
                                        labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            per_engine = self._counters.get(name)
            if per_engine is not None and engine_idx in per_engine and value > 0:
                per_engine[engine_idx].inc(value)


# ----------------------------------------------------------------------------- connector


class KVBlendConnector(KVConnectorBase_V1):
    """CacheBlend + prefix reuse over the kvblend chunk store (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from cluster.config import load_config, log_effective
        from cluster.namespace import namespace_for

        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._stats = _Stats(extra.pop("stats_path", None))
        self.store_tokens_per_step = int(extra.pop("store_tokens_per_step", STORE_TOKENS_PER_STEP))
        if self.store_tokens_per_step < 1:
            raise ValueError(f"kv_connector_extra_config store_tokens_per_step="
                             f"{self.store_tokens_per_step}: must be >= 1")
        self.load_async = extra.pop("load_async", True)
        if not isinstance(self.load_async, bool):
            raise ValueError(f"kv_connector_extra_config load_async={self.load_async!r}: must be true or false")
        self.load_step_s = float(extra.pop("load_step_s", LOAD_STEP_S))
        if not self.load_step_s > 0:
            raise ValueError(f"kv_connector_extra_config load_step_s={self.load_step_s}: must be > 0 seconds")
        self.config = load_config(overrides=extra, overrides_origin="kv_connector_extra_config")
        log_effective(self.config)
        model_config = vllm_config.model_config
        self.model_path = model_config.model
        self.block_size = vllm_config.cache_config.block_size
        self.kv_dtype = str(model_config.dtype).removeprefix("torch.")
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self.enabled = cache_dtype == "auto"
        if not self.enabled:
            log.warning("kvblend: kv_cache_dtype=%s is not supported (KV is stored in the model "
                        "dtype); the connector stays idle", cache_dtype)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        tp_rank = 0
        if role == KVConnectorRole.WORKER and tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self.namespace = namespace_for(self.model_path, self.kv_dtype, tp_rank=tp_rank, tp_size=tp_size)
        self.namespace_digest = self.namespace.digest()
        with all_cpus():  # Ray's threads must not inherit vLLM's one pinned core (cluster.vllm.affinity)
            self.client = make_client(self.config, self.namespace_digest) if self.enabled else None
        self.tp_size = tp_size
        if tp_size > 1 and self.client is not None and role == KVConnectorRole.SCHEDULER:
            self.client = AllRanksLookup(self.client, [
                namespace_for(self.model_path, self.kv_dtype, tp_rank=r, tp_size=tp_size).digest()
                for r in range(tp_size)])
        if tp_size > 1 and self.enabled and self.config.cluster.engine_type == "blend":
            log.warning("kvblend: tensor_parallel_size=%d: blending needs 1 (the vLLM adapter does not "
                        "shard the model yet); prefix reuse only, a chunk hits when every rank stored it",
                        tp_size)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvblend: kv_load_failure_policy=%r: a request whose cached KV cannot be "
                        "produced even by our own prefill fails; set it to 'recompute'",
                        self._kv_transfer_config.kv_load_failure_policy)
        self.counters: dict[str, float] = dict.fromkeys(PROM_COUNTERS, 0)
        self._interval: dict[str, float] = {}  # deltas since vLLM last asked (get_kv_connector_stats)
        self._counter_lock = threading.Lock()
        # scheduler side
        self._tokenizer = None
        self._requests: dict[str, _ReqState] = {}
        self._store_keys: OrderedDict[ChunkKey, None] = OrderedDict()
        # worker side
        self._kv_caches: dict[int, tuple[str, torch.Tensor]] = {}
        self._layout: str | None = None
        self._engine = None
        self._engine_lock = threading.Lock()
        self._source = None  # WorkerKVSource: the worker's gpu tier in front of the client
        self._io_pool: ThreadPoolExecutor | None = None   # puts only; never runs the model
        self._io_futures: list = []
        self._store_queue: OrderedDict[str, _PendingStore] = OrderedDict()  # FIFO by request
        self._store_done: set[str] = set()   # all segments computed, waiting for vLLM's finish
        self._finished_ids: set[str] = set()  # finished by vLLM while their store was pending
        self._invalid_block_ids: set[int] = set()
        self._async_ready: list[str] = []    # scheduler: async claims allocated, not yet sent
        self._loads: OrderedDict[str, _LoadRun] = OrderedDict()  # worker: async loads in flight
        self._recv_done: set[str] = set()    # worker: async loads done (finished_recving)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ helpers

    def _bump(self, **deltas: float) -> None:
        with self._counter_lock:
            for name, value in deltas.items():
                self.counters[name] += value
                self._interval[name] = self._interval.get(name, 0) + value

    # ------------------------------------------------------------------ metrics (vLLM's hooks)

    def get_kv_connector_stats(self) -> KVBlendConnectorStats | None:
        """Counter deltas since the last call (scheduler and worker side alike); vLLM sums
        the workers' and the scheduler's and hands them to :class:`KVBlendPromMetrics`."""
        with self._counter_lock:
            data, self._interval = self._interval, {}
        return KVBlendConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBlendConnectorStats:
        return KVBlendConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self._vllm_config.model_config.tokenizer or self.model_path)
        return self._tokenizer

    def _engine_for_worker(self):
        with self._engine_lock:
            if self._engine is None:
                from blend.adapters.vllm import VLLMModelAdapter
                from blend.engine import BlendEngine
                from cluster.vllm.model_hook import current_model
                from cluster.vllm.worker_source import WorkerKVSource
                from tiers.gpu import GpuTier

                adapter = VLLMModelAdapter(current_model(), model_id=self.namespace.model_id)
                gib = self.config.tiers.gpu_size_gib
                gpu = GpuTier(int(gib * 2**30), device=adapter.device) if gib > 0 else None
                self._source = WorkerKVSource(self.client, gpu, adapter.spec.num_layers)
                self._engine = BlendEngine(adapter, self._source, fetch_thread_initializer=unpin_thread)
            return self._engine

    # ============================================================ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the connector will produce beyond ``num_computed_tokens`` (vLLM's local hit).

        Blend path: ``blend_end - num_computed_tokens`` when the plan blends; prefix path:
        the cached leading prefix chunks beyond the local hit. Never the last prompt token.
        Any failure here: 0 (vLLM computes the request), logged once, counted.
        """
        if not self.enabled:
            return 0, False
        try:
            state = self._plan_request(request)
        except Exception as e:  # noqa: BLE001 - the cache never fails a request
            self._warn_once("lookup", "kvblend: lookup failed (%s: %s); full prefill", type(e).__name__, e)
            self._bump(fallbacks=1)
            self._requests.pop(request.request_id, None)
            return 0, False
        state.loaded = False  # asked again (e.g. resumed after preemption): load again
        claim_end = state.claim_end
        claim = max(0, claim_end - num_computed_tokens)
        state.claim_start = num_computed_tokens if claim else claim_end
        state.load_async = bool(claim and state.plan is not None and state.plan.blend
                                and self._request_params(request).get("kvblend_load_async", self.load_async))
        self._stats.write("claim", request_id=request.request_id, local_computed_tokens=num_computed_tokens,
                          claimed_tokens=claim, claim_end=claim_end, load_async=state.load_async)
        return claim, state.load_async

    def _request_params(self, request: Request) -> dict[str, Any]:
        params = dict(getattr(request, "kv_transfer_params", None) or {})
        out = {}
        for k, v in params.items():
            if k in REQUEST_PARAMS:
                out[k] = v
            elif k.startswith("kvblend"):
                self._warn_once(f"param:{k}", "kvblend: unknown kv_transfer_params key %r ignored "
                                "(known: %s)", k, ", ".join(REQUEST_PARAMS))
        return out

    def _plan_request(self, request: Request) -> _ReqState:
        from blend.planner import make_plan
        from blend.segments import find_segments

        rid = request.request_id
        token_ids = tuple(request.prompt_token_ids or ())
        old = self._requests.get(rid)
        if old is not None and old.token_ids == token_ids:
            return old  # called again for the same request (side-effect free)
        params = self._request_params(request)
        store = bool(params.get("kvblend_store", True)) and self.config.cluster.store_kv
        state = _ReqState(token_ids=token_ids)
        n = len(token_ids)
        blend_cfg = self.config.blend
        if "kvblend_recompute_ratio" in params:
            ratio = float(params["kvblend_recompute_ratio"])
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"kvblend_recompute_ratio={ratio} outside 0..1")
            blend_cfg = dataclasses.replace(blend_cfg, recompute_ratios=(ratio,))
        if not params.get("kvblend_blend", True):
            blend_cfg = dataclasses.replace(blend_cfg, enable_blending=False)
        spans = find_segments(token_ids, self.tokenizer, blend_cfg.blend_separator) if n else []
        has_chunks = any(kind == CHUNK for kind, _, _ in spans)
        path = "none"
        load = bool(params.get("kvblend_load", True))
        if has_chunks and self.config.cluster.engine_type == "blend" and self.tp_size == 1:
            plan = make_plan(token_ids, spans, self.namespace_digest, self.client, blend_cfg)
            state.plan = plan
            if plan.blend and load:
                state.claim_end = plan.blend_end
                path = "blend"
            if store:
                state.store_segments = self._new_store_keys(
                    [(s.key, token_ids[s.start:s.end]) for s in plan.missed_segments if s.end <= n - 1])
            self._stats.write("lookup", request_id=rid, path=path, num_tokens=n,
                              num_segments=len([s for s in plan.segments if s.kind == CHUNK]),
                              num_hit_segments=len(plan.hit_segments),
                              tier_hits=_count_tiers(plan.hit_segments),
                              reusable_tokens=plan.num_reused_tokens, blend_end=plan.blend_end,
                              full_prefill_reason=plan.full_prefill_reason,
                              num_store_segments=len(state.store_segments))
        else:
            chunk = self.config.tiers.chunk_size
            keys = prefix_keys(self.namespace_digest, token_ids, chunk)
            metas = self.client.lookup(keys) if keys else []
            hits = 0
            for meta in metas:
                if meta is None:
                    break
                hits += 1
            # vLLM computes >= 1 token: load whole chunks ending before the last token.
            hits = min(hits, (n - 1) // chunk) if load else 0
            state.prefix_hits = keys[:hits]
            state.claim_end = hits * chunk
            if state.claim_end:
                path = "prefix"
            if store:
                todo = self._new_store_keys([(k, ()) for k in keys[hits:]])
                todo_keys = {k for k, _ in todo}
                state.store_prefix = [(k, i * chunk, (i + 1) * chunk) for i, k in enumerate(keys)
                                      if k in todo_keys]
            self._stats.write("lookup", request_id=rid, path=path, num_tokens=n,
                              num_prefix_chunks=len(keys), num_prefix_hits=hits,
                              num_store_prefix=len(state.store_prefix))
        self._bump(requests=1)
        self._requests[rid] = state
        return state

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

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVBlendConnectorMetadata()
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
            resumed = rid in cached.resumed_req_ids
            if new_blocks is not None:
                state.block_ids = list(new_blocks[0]) if resumed else state.block_ids + list(new_blocks[0])
            n_sched = scheduler_output.num_scheduled_tokens.get(rid, 0)
            scheduled.append((rid, state.block_ids, cached.num_computed_tokens[i] + n_sched, resumed))
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
            store = StoreSpec(rid)
            if state.store_segments:
                store.segments, state.store_segments = state.store_segments, []
                state.store_sent = True
            ready = [p for p in state.store_prefix if p[2] <= computed_after]
            if ready:
                state.store_prefix = [p for p in state.store_prefix if p[2] > computed_after]
                store.prefix = [(k, paged.slot_mapping_for(block_ids, self.block_size, s, e)) for k, s, e in ready]
            if store.segments or store.prefix:
                meta.stores.append(store)
        return meta

    def _load_spec(self, rid: str, state: _ReqState, block_ids: list[int]) -> LoadSpec:
        slots = paged.slot_mapping_for(block_ids, self.block_size, state.claim_start, state.claim_end)
        chunk = self.config.tiers.chunk_size
        prefix = [(k, i * chunk, (i + 1) * chunk) for i, k in enumerate(state.prefix_hits)]
        self._bump(claimed_tokens=state.claim_end - state.claim_start)
        return LoadSpec(rid, state.claim_start, state.claim_end, slots, list(block_ids), self.block_size,
                        plan=state.plan if state.plan and state.plan.blend else None, prefix=prefix,
                        token_ids=state.token_ids[:state.claim_end], load_async=state.load_async)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks (``True``) of a request whose canonical segments were sent to the
        worker for storing: vLLM keeps stepping until the worker reports it in
        ``finished_sending``, which drains the store queue even when no other request runs."""
        state = self._requests.pop(request.request_id, None)
        return bool(state is not None and state.store_sent), None

    # =============================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.platforms import current_platform

        for name, cache in kv_caches.items():
            m = re.search(r"layers\.(\d+)\.", name)
            if m is None or not isinstance(cache, torch.Tensor):
                continue
            self._kv_caches[int(m.group(1))] = (name, cache)
            if self._layout is None:
                self._layout = paged.detect_layout(cache, current_platform.is_cpu())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads; advance the async ones (see the module docstring).

        vLLM calls it before the forward when the step has synchronous loads, else after it."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBlendConnectorMetadata):
            return
        layers = getattr(forward_context, "no_compile_layers", {}) or {}
        for spec in meta.loads:
            run = self._begin_load(spec, layers)
            if run is None:
                continue
            if spec.load_async:
                self._loads[spec.request_id] = run
            else:
                self._advance(run, None)
        if self._loads:
            self._advance_async(meta.idle)

    def _write_layer(self, layers: dict, layer_idx: int, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``kv`` ``[2, T, H, D]`` of one layer at ``slots`` through the backend's own
        cache-update op (falls back to :func:`cluster.vllm.paged.scatter_kv`)."""
        name, cache = self._kv_caches[layer_idx]
        layer = layers.get(name)
        impl = getattr(layer, "impl", None)
        k = kv[0].to(cache.dtype).contiguous()
        v = kv[1].to(cache.dtype).contiguous()
        if impl is not None and hasattr(impl, "do_kv_cache_update"):
            impl.do_kv_cache_update(layer, k, v, cache, slots.to(cache.device))
        else:
            paged.scatter_kv(cache, self._layout, kv, slots)

    def _begin_load(self, spec: LoadSpec, layers: dict) -> _LoadRun | None:
        """A blend load ready to step; a prefix load (or a load that cannot start) is done
        here and then returns None."""
        start_s = time.perf_counter()
        start, end = spec.load_start, spec.load_end

        def on_layer(layer_idx: int, kv: torch.Tensor) -> None:  # kv [2, N, H, D]
            if kv.shape[1] < end:
                raise RuntimeError(f"engine produced {kv.shape[1]} rows, {end} claimed")
            if not bool(torch.isfinite(kv[:, start:end]).all()):
                raise RuntimeError(f"non-finite KV in layer {layer_idx}")
            self._write_layer(layers, layer_idx, kv[:, start:end], spec.slot_mapping)

        record: dict[str, Any] = {"request_id": spec.request_id, "load_start": start, "load_end": end,
                                  "load_async": spec.load_async}
        run = _LoadRun(spec, record, None, on_layer, start_s)
        try:
            if spec.plan is None:
                self._load_prefix(spec, layers)
                record.update(path="prefix", num_prefix_chunks=len(spec.prefix), fallback=False)
                self._bump(prefix_requests=1)
            else:
                engine = self._engine_for_worker()
                record["gpu_hit_segments"] = self._source.gpu_hits([seg.key for seg in spec.plan.hit_segments])
                self._bump(gpu_hit_segments=record["gpu_hit_segments"])
                run.steps = engine.blend_steps(spec.plan, want_logits=False, on_layer=on_layer)
                return run
        except Exception as e:  # noqa: BLE001 - never fail the request for the cache's sake
            self._load_failed(run, e)
        self._end_load(run)
        return None

    def _advance(self, run: _LoadRun, deadline: float | None) -> bool:
        """Step ``run``'s blend until it ends (True) or ``perf_counter()`` passes ``deadline``
        (False; at least one layer). None: to the end."""
        run.num_engine_steps += 1
        try:
            with torch.inference_mode():
                while True:
                    try:
                        next(run.steps)
                    except StopIteration as stop:
                        self._blend_done(run, stop.value)
                        break
                    if deadline is not None and time.perf_counter() >= deadline:
                        return False
        except Exception as e:  # noqa: BLE001 - never fail the request for the cache's sake
            run.steps.close()
            self._load_failed(run, e)
        self._end_load(run)
        return True

    def _advance_async(self, idle: bool) -> None:
        """Oldest async load first, about ``load_step_s`` seconds (all of it when ``idle``)."""
        deadline = None if idle else time.perf_counter() + self.load_step_s
        while self._loads:
            rid, run = next(iter(self._loads.items()))
            run.busy_steps += not idle
            if not self._advance(run, deadline):
                return
            del self._loads[rid]
            self._recv_done.add(rid)
            if deadline is not None and time.perf_counter() >= deadline:
                return

    def _blend_done(self, run: _LoadRun, result) -> None:
        c = result.counters
        run.record.update(path="blend", num_segments=c.num_segments, num_hit_segments=c.num_hit_segments,
                          reused_tokens=c.reused_tokens, computed_tokens=c.computed_tokens,
                          selected_tokens=c.selected_tokens,
                          recomputed_tokens_per_layer=c.recomputed_tokens_per_layer,
                          load_wait_s=c.load_wait_s, compute_s=c.compute_s,
                          full_prefill_reason=c.full_prefill_reason,
                          fallback=c.full_prefill_reason is not None)
        self._bump(blend_requests=1, segments=c.num_segments, hit_segments=c.num_hit_segments,
                   reused_tokens=c.reused_tokens, selected_tokens=c.selected_tokens,
                   computed_tokens=c.computed_tokens, load_wait_s=c.load_wait_s)
        if c.full_prefill_reason is not None:
            self._bump(fallbacks=1)

    def _load_failed(self, run: _LoadRun, e: Exception) -> None:
        """Recompute the claimed KV by full prefill through the same adapter; if even that
        fails, report the claimed blocks to vLLM (``get_block_ids_with_load_errors``)."""
        spec, record = run.spec, run.record
        self._warn_once("load", "kvblend: load of request %s failed (%s: %s); recomputing by "
                        "full prefill", spec.request_id, type(e).__name__, e)
        log.debug("kvblend load failure", exc_info=True)
        self._bump(fallbacks=1)
        record.update(fallback=True, error=f"{type(e).__name__}: {e}")
        try:
            with torch.inference_mode():
                self._engine_for_worker().prefill(list(spec.token_ids[:spec.load_end]), want_logits=False,
                                                  on_layer=run.on_layer)
            record["recovered_by"] = "full_prefill"
        except Exception as e2:  # noqa: BLE001
            self._warn_once("load2", "kvblend: full prefill of request %s failed too (%s: %s); "
                            "reporting its blocks to vLLM", spec.request_id, type(e2).__name__, e2)
            self._bump(load_errors=1)
            record["recovered_by"] = "vllm"
            bs = spec.block_size
            self._invalid_block_ids.update(spec.block_ids[t // bs] for t in range(spec.load_start, spec.load_end))

    def _end_load(self, run: _LoadRun) -> None:
        run.record.update(wall_s=time.perf_counter() - run.start_s, engine_steps=run.num_engine_steps,
                          busy_steps=run.busy_steps)
        self._stats.write("load", **run.record)

    def _load_prefix(self, spec: LoadSpec, layers: dict) -> None:
        """Exact prefix chunks: each layer of every chunk, written at its slots."""
        keys = [k for k, _, _ in spec.prefix]
        num_layers = len(self._kv_caches)
        for layer_idx in range(num_layers):
            got = self.client.fetch_layer(keys, layer_idx).result(timeout=self.config.cluster.call_timeout_s * 10)
            if any(t is None for t in got):
                raise RuntimeError(f"prefix chunk layer {layer_idx} unreadable")
            kv = torch.cat(list(got), dim=1)  # [2, hits * chunk_size, H, D]
            self._write_layer(layers, layer_idx, kv[:, spec.load_start:spec.load_end], spec.slot_mapping)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync loads are complete when start_load_kv returns; async ones are reported

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # stores run after the step (wait_for_save)

    def wait_for_save(self):
        """Drain store work queued by earlier steps (bounded), then queue this step's.

        Runs on the worker's thread after the forward: canonical segments are computed here
        (:meth:`_drain_store_queue`), never in the step that computes their own request's
        prompt. Prefix chunks are gathered from the paged cache now (their blocks may be
        reused later) and put by the I/O thread.
        """
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBlendConnectorMetadata):
            return
        # a step that computes a prompt, or whose async loads a request waits for, computes no
        # stores (unless they waited STORE_MAX_DEFER_S): they would delay a first token
        busy = meta.has_prefill or bool(self._loads) or bool(self._recv_done)
        self._drain_store_queue(busy, self.store_tokens_per_step)
        now = time.monotonic()
        for spec in meta.stores:
            if spec.prefix:
                prefix = []
                for key, slots in spec.prefix:
                    try:
                        kv = torch.stack([paged.gather_kv(self._kv_caches[i][1], self._layout, slots)
                                          for i in range(len(self._kv_caches))])  # [L, 2, T, H, D]
                        prefix.append((key, kv))
                    except Exception as e:  # noqa: BLE001
                        self._warn_once("gather", "kvblend: prefix store skipped (%s: %s)", type(e).__name__, e)
                self._io_submit(self._put_prefix, spec.request_id, prefix)
            if spec.segments:
                pend = self._store_queue.get(spec.request_id)
                if pend is None:
                    pend = self._store_queue[spec.request_id] = _PendingStore(spec.request_id, enqueued_s=now)
                pend.segments.extend(spec.segments)

    def _drain_store_queue(self, has_prefill: bool, budget_tokens: int | None) -> None:
        """Compute queued canonical segments, oldest request first, about ``budget_tokens``
        tokens (at least one segment; ``None``: everything). In a step with prefill tokens
        (or async loads) only work older than :data:`STORE_MAX_DEFER_S` runs."""
        if not self._store_queue:
            return
        oldest = next(iter(self._store_queue.values()))
        if has_prefill and time.monotonic() - oldest.enqueued_s < STORE_MAX_DEFER_S:
            return
        spent = 0
        while self._store_queue and (budget_tokens is None or spent < budget_tokens):
            pend = next(iter(self._store_queue.values()))
            if pend.segments and pend.stored == pend.skipped == 0 and pend.error is None:
                self._drop_present(pend)
            if pend.segments:
                key, ids = pend.segments.popleft()
                spent += self._store_segment(pend, key, ids)
            if not pend.segments:
                del self._store_queue[pend.request_id]
                self._store_done.add(pend.request_id)
                self._io_submit(self._finish_store, pend)

    def _drop_present(self, pend: _PendingStore) -> None:
        """One batched ``contains`` for a request's segments: skip those already cached."""
        try:
            present = self.client.contains([k for k, _ in pend.segments])
        except Exception as e:  # noqa: BLE001 - unknown: compute them (put is idempotent)
            self._warn_once("contains", "kvblend: contains failed (%s: %s)", type(e).__name__, e)
            return
        keep = deque(item for item, have in zip(pend.segments, present, strict=True) if not have)
        pend.skipped += len(pend.segments) - len(keep)
        pend.segments = keep

    def _store_segment(self, pend: _PendingStore, key: ChunkKey, ids: tuple[int, ...]) -> int:
        """Canonical KV of one segment (``engine.prefill`` at positions ``0..n-1``), handed to
        the I/O thread. Returns the tokens computed. Errors are recorded, never raised."""
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                result = self._engine_for_worker().prefill(list(ids), want_logits=False)
            kv = torch.stack(result.kv).cpu()  # [L, 2, T, H, D]
            if not bool(torch.isfinite(kv).all()):
                raise RuntimeError(f"non-finite canonical KV for {key}; not stored")
            self._io_submit(self.client.put, key, kv)
            self._source.remember(key, kv)
            pend.stored += 1
            pend.tokens += len(ids)
        except Exception as e:  # noqa: BLE001 - a failed store is a future miss
            pend.error = f"{type(e).__name__}: {e}"
            self._warn_once("store", "kvblend: store for request %s failed (%s)", pend.request_id, pend.error)
        pend.seconds += time.perf_counter() - start
        return len(ids)

    def _io_submit(self, fn, *args) -> None:
        if self._io_pool is None:
            self._io_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvblend-store-io",
                                               initializer=unpin_thread)
        self._io_futures = [f for f in self._io_futures if not f.done()]
        self._io_futures.append(self._io_pool.submit(fn, *args))

    def _finish_store(self, pend: _PendingStore) -> None:
        """I/O thread, after the request's puts (FIFO): flush, count, one ``store`` event."""
        error = pend.error
        try:
            if pend.stored and not self.client.flush(timeout_s=60.0):
                error = error or "flush timed out"
        except Exception as e:  # noqa: BLE001
            error = error or f"{type(e).__name__}: {e}"
        self._count_store(pend.request_id, pend.stored, pend.skipped, pend.tokens, pend.seconds, error)

    def _put_prefix(self, request_id: str, prefix) -> None:
        """I/O thread: put gathered prefix chunks ``(key, kv[L, 2, T, H, D])``, flush, count."""
        start = time.perf_counter()
        stored = tokens = 0
        error = None
        try:
            for key, kv in prefix:
                self.client.put(key, kv.cpu(), positions=None)
                stored += 1
                tokens += kv.shape[2]
            if stored and not self.client.flush(timeout_s=60.0):
                error = "flush timed out"
        except Exception as e:  # noqa: BLE001 - a failed store is a future miss
            error = f"{type(e).__name__}: {e}"
            self._warn_once("store", "kvblend: store for request %s failed (%s)", request_id, error)
        self._count_store(request_id, stored, 0, tokens, time.perf_counter() - start, error)

    def _count_store(self, request_id, stored, skipped, tokens, seconds, error) -> None:
        self._bump(stored_chunks=stored, stored_tokens=tokens, store_skipped=skipped, store_s=seconds)
        self._stats.write("store", request_id=request_id, stored=stored, skipped=skipped,
                          tokens=tokens, seconds=seconds, error=error)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``finished_sending``: requests whose blocks ``request_finished`` held and whose
        canonical segments are all computed (their puts continue on the I/O thread).
        ``finished_recving``: async loads done, or abandoned because vLLM finished (aborted)
        the request meanwhile."""
        for rid in set(finished_req_ids) & set(self._loads):
            run = self._loads.pop(rid)
            run.steps.close()
            run.record.update(aborted=True)
            self._end_load(run)
            self._recv_done.add(rid)
        held = set(self._store_queue) | self._store_done
        self._finished_ids |= set(finished_req_ids) & held
        done = {r for r in self._finished_ids if r in self._store_done}
        self._finished_ids -= done
        self._store_done -= done
        recving, self._recv_done = self._recv_done, set()
        return (done or None), (recving or None)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Compute every queued store and wait for the puts. Call it only where vLLM is not
        running the model (the worker's own thread: :meth:`shutdown`)."""
        deadline = time.monotonic() + timeout_s
        self._drain_store_queue(False, None)
        for f in list(self._io_futures):
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001
                return False
        return self.client.flush(timeout_s=max(0.0, deadline - time.monotonic())) if self.client else True

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out

    def shutdown(self):
        for run in self._loads.values():
            run.steps.close()
        self._loads.clear()
        try:
            self.flush(timeout_s=30.0)
        finally:
            if self._io_pool is not None:
                self._io_pool.shutdown(wait=False)
