"""``KVBlendConnector``: CacheBlend and chunk storage inside stock vLLM (KV connector API v1).

Load it with ``KVTransferConfig(kv_connector="KVBlendConnector", kv_role="kv_both",
kv_connector_module_path="cluster.connector", kv_connector_extra_config={...})`` or, with
kvblend installed, ``vllm serve MODEL --kv-transfer-config '{"kv_connector":"KVBlendConnector",
"kv_role":"kv_both"}'`` (the ``kvblend`` general plugin registers the short name).

This module is the thin facade vLLM instantiates, once per role; each hook delegates to the half
of its role, as vLLM's own larger connectors do:

=============================================  ==============================================
:mod:`cluster.vllm.scheduler`                  lookup, claims, planning, connector metadata,
                                               ``request_finished``
:mod:`cluster.vllm.tp_lookup`                  :class:`AllRanksLookup`, the scheduler's lookups
                                               under tensor parallelism
:mod:`cluster.vllm.worker`                     blend and prefix loads into the paged cache,
                                               ``get_finished``, load errors
:mod:`cluster.vllm.store_queue`                canonical-KV compute queue, puts on an I/O thread
:mod:`cluster.vllm.metadata`                   ``LoadSpec``/``StoreSpec`` sent scheduler -> worker
:mod:`cluster.vllm.options`                    connector-only extra-config keys, request params
:mod:`cluster.vllm.events`                     the JSON-lines event log (vLLM-free)
:mod:`cluster.vllm.metrics`                    counters, vLLM stats and Prometheus classes
=============================================  ==============================================

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
:class:`blend.engine.BlendEngine` runs over :func:`blend.adapters.vllm.vllm_adapter`'s model (the fused
Llama layers over vLLM's weights; vLLM's modules for other models)
and :class:`cluster.vllm.worker_source.WorkerKVSource` (the worker's gpu tier of ``gpu_size_gib``
in front of the cache client; the load event's ``gpu_hit_segments`` counts its hits), and each
layer's final KV is written at the request's slots by the attention backend's own
``do_kv_cache_update`` (correct for every paged layout and CPU ISA; :mod:`cluster.vllm.paged`
is the plain-torch reference and the read path). Any failure: the request's KV is recomputed by
full prefill through the same adapter; if even that fails, its blocks are reported by
``get_block_ids_with_load_errors`` (set vLLM's ``kv_load_failure_policy="recompute"`` so vLLM
recomputes them instead of failing the request). Never partial KV: the last write per layer
wins and every claimed slot is written.

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

Store side (:mod:`cluster.vllm.store_queue`): the canonical (standalone, positions ``0..n-1``)
KV of chunk segments not yet cached is computed with ``engine.prefill`` on the worker's own
thread, never concurrently with vLLM. It is deduplicated in the scheduler (a key is scheduled
once) and in the worker (``contains`` before computing), queued, and computed in
``wait_for_save`` of *later* steps — not in the step that computes the request's prefill, so it
never delays a first token — at most ``store_tokens_per_step`` tokens per step (a whole segment
at least; steps with prefill tokens skip the queue unless its oldest item waited
:data:`cluster.vllm.store_queue.STORE_MAX_DEFER_S`). To keep vLLM stepping until the queue
drains, ``request_finished`` holds the request's blocks (returns ``True``) while its segments
are pending, and the worker reports it in ``get_finished``'s ``finished_sending`` once they are
done; an idle engine then runs empty steps that only drain the queue. Puts go to the client
from a background I/O thread (no model use). Prefix chunks are gathered from the paged cache
after the forward that computed them and put the same way.

**Reaching the model** (no vLLM source patch): :mod:`cluster.vllm.model_hook` — the kvblend
general plugin registers tracking subclasses of vLLM's model classes; the worker-side connector
takes the model built in its process from :func:`cluster.vllm.model_hook.current_model`.

**Metrics** (:mod:`cluster.vllm.metrics`): our counters (``PROM_COUNTERS``) go through vLLM's
connector stats hooks (``get_kv_connector_stats`` on both sides, ``build_kv_connector_stats``,
``build_prom_metrics``) to vLLM's ``/metrics`` as ``vllm:kvblend_<name>_total``; vLLM's own
``vllm:external_prefix_cache_hits_total`` counts the tokens the connector claimed.

**Events** (:mod:`cluster.vllm.events`): every decision appends one JSON line to
``kv_connector_extra_config["stats_path"]`` when set (``{"event": "lookup"|"claim"|"load"|
"store", "request_id": ..., ...}``; readable by tests and the demo from the front-end process,
across vLLM's engine-core process boundary); cumulative counters are also in
:attr:`KVBlendConnector.counters`. Each connector also writes one ``"start"`` event (``request_id``
``""``) with its role, namespace digest, model id and tp rank.

**Namespace** (:func:`cluster.namespace.namespace_for`): from ``model_config.model`` as vLLM
resolved it (a folder, or a Hub id read from the local Hugging Face cache, never the network),
``revision``, ``hf_overrides``, ``quantization``, the served dtype and this rank; the scheduler logs
it once (``kvblend: namespace <digest> ...``), the same line ``kvblend ingest`` prints.

Options (:mod:`cluster.vllm.options`): our config (YAML/env/LMCache aliases,
:func:`cluster.config.load_config`) overridden by ``kv_connector_extra_config`` (our field
names, plus the connector-only ``stats_path``, ``store_tokens_per_step``, ``load_async``,
``load_step_s``). Per request, ``SamplingParams(extra_args={"kv_transfer_params": {...}})``
with ``kvblend_load`` (False: load nothing, vLLM computes the prompt), ``kvblend_blend``
(False: no blending), ``kvblend_recompute_ratio`` (float in [0, 1]), ``kvblend_store`` (False:
store nothing), ``kvblend_load_async`` (bool: this request's blend on the async path or not),
``kvblend_selection``: all of them only with ``allow_request_overrides`` (default off, issue 37).

Tensor parallelism (``tensor_parallel_size`` > 1): prefix reuse only (the vLLM adapter does
not shard the model, so the connector does not blend; a warning says so); each rank stores and
loads its own KV heads under its own namespace, and the scheduler's lookups go through
:class:`AllRanksLookup` (a chunk hits only when every rank stored it).

Client: :func:`cluster.cache.factory.make_client` — the Ray-sharded ``CacheClient`` when Ray and
shards are reachable, else one machine-local client shared by every connector of this process
(scheduler and worker roles live in the same engine-core process on the CPU backend, so they
see the same cache).

Threads: vLLM calls every hook below on one thread of its process — the engine core's busy
loop for the scheduler role, the thread that runs the model for the worker role (on the CPU
backend with one worker, the same thread of the engine-core process). No hook may raise for the
cache's sake (a cache fault is a miss and a counter), and no hook may run the model except
``start_load_kv`` and ``wait_for_save``, between forwards.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cluster.cache.factory import make_client
from cluster.vllm.affinity import all_cpus, unpin_thread
from cluster.vllm.compat import (
    KVBlendHMAMixin,
    KVBlendHooksMixin,
    refuse_unsupported,
)
from cluster.vllm.costs import cost_model_for
from cluster.vllm.events import EventLog, WarnOnce
from cluster.vllm.metadata import KVBlendConnectorMetadata, KVBlendWorkerMetadata
from cluster.vllm.metrics import Counters, KVBlendConnectorStats, KVBlendPromMetrics
from cluster.vllm.options import ConnectorOptions
from cluster.vllm.scheduler import KVBlendScheduler
from cluster.vllm.tp_lookup import AllRanksLookup
from cluster.vllm.worker import KVBlendWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["AllRanksLookup", "KVBlendConnector", "KVBlendConnectorMetadata"]

log = logging.getLogger("kvblend.connector")


class KVBlendConnector(KVBlendHooksMixin, KVBlendHMAMixin, KVConnectorBase_V1):
    """CacheBlend + prefix reuse over the kvblend chunk store (see the module docstring).

    vLLM builds one per role: ``connector_scheduler`` (a :class:`KVBlendScheduler`) is set in
    the scheduler's instance, ``connector_worker`` (a :class:`KVBlendWorker`) in each worker's.
    It is ``SupportsHMA`` (vLLM keeps its hybrid KV cache manager on) and stays idle, with one
    warning, for a model with several KV cache groups or with sliding-window attention shorter
    than ``max_model_len`` (:mod:`cluster.vllm.compat`).

    Raises:
        ValueError: a malformed ``kv_connector_extra_config`` key or config value (start-up
            stops with the key named).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from cluster.config import load_config, log_config

        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        options = ConnectorOptions.pop_from(extra)
        self.config = load_config(overrides=extra, overrides_origin="kv_connector_extra_config")
        log_config(self.config)  # secrets masked (issue 19)
        model_config = vllm_config.model_config
        self.model_path = model_config.model
        self.kv_dtype = str(model_config.dtype).removeprefix("torch.")
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self.enabled = cache_dtype == "auto"
        if not self.enabled:
            log.warning("kvblend: kv_cache_dtype=%s is not supported (KV is stored in the model "
                        "dtype); the connector stays idle", cache_dtype)
        pp_size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        if pp_size > 1 and self.enabled:  # each stage holds some layers; chunks hold all of them
            self.enabled = False
            log.warning("kvblend: pipeline_parallel_size=%d is not supported (a chunk holds every "
                        "layer); the connector stays idle", pp_size)
        if self.enabled and refuse_unsupported(model_config, kv_cache_config, role):  # sliding window, several groups
            self.enabled = False
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.namespace = self._namespace(self._tp_rank(role))
        self.namespace_digest = self.namespace.digest()
        if role == KVConnectorRole.SCHEDULER:  # `kvblend ingest` prints the same line: compare them
            log.info("kvblend: namespace %s (model %s, dtype %s, overrides %s, quantization %s, tp %d)",
                     self.namespace_digest, self.namespace.model_id, self.kv_dtype,
                     self.namespace.overrides or "none", self.namespace.quantization or "none", self.tp_size)
        self.client = self._make_client(role)
        if self.tp_size > 1 and self.enabled and self.config.cluster.engine_type == "blend":
            log.warning("kvblend: tensor_parallel_size=%d: blending needs 1 (the vLLM adapter does not "
                        "shard the model yet); prefix reuse only, a chunk hits when every rank stored it",
                        self.tp_size)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvblend: kv_load_failure_policy=%r: a request whose cached KV cannot be "
                        "produced even by our own prefill fails; set it to 'recompute'",
                        self._kv_transfer_config.kv_load_failure_policy)
        self._counters = Counters()
        self.counters: dict[str, float] = self._counters.totals
        events, warn = EventLog(options.stats_path), WarnOnce()
        events.write("start", request_id="", role=role.name.lower(), namespace=self.namespace_digest,
                     model_id=self.namespace.model_id, tp_rank=self.namespace.tp_rank, enabled=self.enabled)
        self.connector_scheduler: KVBlendScheduler | None = None
        self.connector_worker: KVBlendWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVBlendScheduler(
                self.config, self.client, namespace_digest=self.namespace_digest,
                block_size=vllm_config.cache_config.block_size, load_tokenizer=self._load_tokenizer,
                tp_size=self.tp_size, load_async=options.load_async,
                allow_request_overrides=options.allow_request_overrides, events=events,
                counters=self._counters, warn=warn, **cost_model_for(vllm_config))
        else:
            self.connector_worker = KVBlendWorker(
                self.config, self.client, model_id=self.namespace.model_id,
                store_tokens_per_step=options.store_tokens_per_step, load_step_s=options.load_step_s,
                counters=self._counters, events=events, warn=warn)

    def _namespace(self, tp_rank: int):
        """The :class:`tiers.keys.Namespace` of ``tp_rank`` for the model as vLLM resolved it (a
        folder, or a Hub id read from the local Hugging Face cache), with its revision,
        ``hf_overrides`` and quantization (:func:`cluster.namespace.namespace_for`)."""
        from cluster.namespace import fingerprint_cache_path, namespace_for

        mc = self._vllm_config.model_config
        return namespace_for(self.model_path, self.kv_dtype, revision=getattr(mc, "revision", None),
                             hf_overrides=getattr(mc, "hf_overrides", None),
                             quantization=getattr(mc, "quantization", None), tp_rank=tp_rank,
                             tp_size=self.tp_size, fingerprint_cache=fingerprint_cache_path(self.config))

    def _tp_rank(self, role: KVConnectorRole) -> int:
        """This worker's tensor-parallel rank (0 for the scheduler, which speaks for all)."""
        if role == KVConnectorRole.WORKER and self.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return get_tensor_model_parallel_rank()
        return 0

    def _make_client(self, role: KVConnectorRole):
        """This rank's cache client (None when the connector is idle); under TP the
        scheduler's client looks chunks up on every rank (:class:`AllRanksLookup`)."""
        with all_cpus():  # Ray's threads must not inherit vLLM's one pinned core (cluster.vllm.affinity)
            client = (make_client(self.config, self.namespace_digest, thread_initializer=unpin_thread,
                                   fallback_on_error=True, agent=self.config.cluster.ray_client == "agent")
                      if self.enabled else None)
        if self.tp_size > 1 and client is not None and role == KVConnectorRole.SCHEDULER:
            client = AllRanksLookup(client, [self._namespace(r).digest() for r in range(self.tp_size)])
        return client

    def _load_tokenizer(self):
        """vLLM's tokenizer, from the local folder when it is a cached Hub id (no Hub calls)."""
        from transformers import AutoTokenizer

        from cluster.namespace import resolve_model_path

        mc = self._vllm_config.model_config
        name = mc.tokenizer or self.model_path
        try:
            name = resolve_model_path(name, getattr(mc, "tokenizer_revision", None))
        except ValueError:
            pass  # not cached: transformers resolves it as vLLM's front end did
        return AutoTokenizer.from_pretrained(name)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Worker: compute every queued store and wait for its puts (True when done within
        ``timeout_s``). Runs the model: call it only where vLLM is not running it
        (:func:`cluster.vllm.offline.settle`). Scheduler: nothing to flush (True)."""
        return self.connector_worker.flush(timeout_s) if self.connector_worker is not None else True

    # ================================================================ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's block-aligned local prefix hit) that
        the connector will produce, and whether they load asynchronously.

        When: in ``Scheduler.schedule()`` for a waiting request not yet computed, before its
        blocks are allocated; again for the same request when it was skipped or preempted (the
        lookup for one prompt is reused, not repeated; each call resets the request's claim to
        this answer, marks it not yet loaded, and writes a ``claim`` event). Where: scheduler process, the engine core's busy-loop thread.
        Never: raise (a failed lookup answers ``(0, False)`` and counts a fallback), claim the
        last prompt token, or block beyond one batched lookup of the request's chunks (and,
        on the first call, loading the tokenizer). Requests vLLM computes whole (prompt
        logprobs, pooling: :func:`cluster.vllm.compat.skips_external_kv`) claim nothing and
        only store.
        """
        if not self.enabled:
            return 0, False
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        """Record the request's blocks once vLLM allocated them.

        When: in ``Scheduler.schedule()`` right after a waiting request's blocks are
        allocated (``num_external_tokens`` = what :meth:`get_num_new_matched_tokens` claimed,
        0 when vLLM chose not to load); for an async claim also a second time, after the load.
        Where: scheduler process, busy-loop thread. Never: raise or do I/O.
        """
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's :class:`KVBlendConnectorMetadata`: loads and stores for the workers.

        When: once at the end of every ``Scheduler.schedule()`` (also for steps that schedule
        nothing). Where: scheduler process, busy-loop thread; the result is shipped to every
        worker with the ``SchedulerOutput``. Never: modify ``scheduler_output``, raise, or
        block (it computes slot mappings only).
        """
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM must keep the request's blocks until the worker reports it in
        ``finished_sending`` (True while its canonical segments are queued for storing);
        no ``kv_transfer_params`` are returned.

        When: exactly once per request, when it finishes or is aborted, before its blocks are
        freed. Where: scheduler process, busy-loop thread. Never: raise or block.
        """
        return self.connector_scheduler.request_finished(request, block_ids)

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Take vLLM's paged KV caches (layer name -> tensor) and detect their layout.

        When: once, after the worker allocated its KV cache (``initialize_kv_cache``, not
        during memory profiling). Where: worker process, its main thread. Never: copy or
        resize the tensors (vLLM owns them).
        """
        if self.enabled:  # an idle connector (e.g. hybrid groups) never reads them
            self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Run this step's loads: synchronous ones to the end, async blends a slice.

        When: every engine step of a worker, with this step's metadata bound — before the
        forward when the step has synchronous loads (``has_sync_kv_loads``: prefix loads,
        ``load_async=False``), else after the forward was launched. Where: worker process,
        the thread that runs the model (so running the blend engine here is safe). Never:
        raise (a failed load is recomputed by full prefill, or its blocks reported by
        :meth:`get_block_ids_with_load_errors`), or leave a claimed slot unwritten.
        """
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBlendConnectorMetadata):
            return
        layers = getattr(forward_context, "no_compile_layers", {}) or {}
        self.connector_worker.start_load_kv(meta, layers)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: sync loads are complete when :meth:`start_load_kv` returns; async ones are
        reported in ``finished_recving``.

        When: inside every attention layer's forward, before attention (vLLM's
        ``maybe_transfer_kv_layer``). Where: worker, the model's thread, mid-forward. Never:
        block, or touch the model or the caches.
        """
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Nothing: stores run after the step (:meth:`wait_for_save`).

        When: inside every attention layer's forward, after attention. Where: worker, the
        model's thread, mid-forward. Never: block, or touch the model.
        """
        return

    def wait_for_save(self):
        """Compute queued canonical segments (bounded per step), gather this step's prefix
        chunks from the paged cache and hand the puts to the I/O thread.

        When: once per engine step, empty steps included, after the forward and
        :meth:`start_load_kv`, with the metadata still bound. Where: worker process, the
        model's thread (so computing canonical KV here never overlaps a vLLM forward). Never:
        raise (a failed store is a future miss), block on the puts, or compute stores in a
        step with prefill tokens unless they waited ``STORE_MAX_DEFER_S``.
        """
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBlendConnectorMetadata):
            return
        self.connector_worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)``: requests whose held blocks may be freed
        (canonical segments all computed), and async loads done or abandoned.

        When: every engine step after :meth:`wait_for_save` (through vLLM's
        ``get_transfer_results``), with the ids vLLM finished since the last step. Where:
        worker process, the model's thread. Never: raise, or report a sending id vLLM has not
        finished (one of ``finished_req_ids`` of this or an earlier call).
        """
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose claimed KV neither the blend nor our full prefill could produce;
        vLLM recomputes them (``kv_load_failure_policy="recompute"``).

        When: every engine step, after :meth:`get_finished`. Where: worker process, the
        model's thread. Never: raise; each block is reported once.
        """
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self):
        """Worker: abandon async loads, compute and put queued stores (30 s at most), stop the
        I/O thread. Scheduler: nothing.

        When: once, as vLLM stops — the engine core's ``Scheduler.shutdown()`` for the
        scheduler role, the worker's shutdown for the worker role. Where: that process's main
        thread. Never: raise for the cache's sake, or wait without bound.
        """
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ================================================================ cost samples (issue 34)

    def build_connector_worker_meta(self) -> KVBlendWorkerMetadata | None:
        """The cost samples this worker measured since the last step (blends, prefills), for
        the scheduler half's estimates; None when there are none.

        When: every engine step, after the step's connector work. Where: the worker's model
        thread. Never: block or raise.
        """
        w = self.connector_worker
        samples = w.take_cost_samples() if w is not None else None
        return KVBlendWorkerMetadata(samples) if samples else None

    def update_connector_output(self, connector_output) -> None:
        """Fold the workers' cost samples (``connector_output.kv_connector_worker_meta``) into
        the scheduler half's estimates (:class:`~cluster.vllm.costs.CostEstimator`).

        When: every engine step that has workers' output. Where: the scheduler's busy-loop
        thread. Never: raise (a foreign or malformed metadata object is ignored).
        """
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        s = self.connector_scheduler
        if isinstance(meta, KVBlendWorkerMetadata) and s is not None and s.costs is not None:
            s.costs.add(meta.samples)

    # ================================================================ metrics (both sides)

    def get_kv_connector_stats(self) -> KVBlendConnectorStats | None:
        """Counter deltas since the last call (None when nothing was counted); vLLM sums the
        workers' and the scheduler's and hands them to :class:`KVBlendPromMetrics`.

        When: every engine step — the worker's after :meth:`get_block_ids_with_load_errors`,
        the scheduler's in ``update_from_output``. Where: that role's thread. Never: block
        (the counters' lock is only held to swap the interval).
        """
        data = self._counters.take_interval()
        return KVBlendConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBlendConnectorStats:
        """Our stats class around ``data`` (name -> delta), as received from the engine.

        When: each time stats arrive at vLLM's stat loggers (``KVConnectorLogging.observe``).
        Where: the front-end (API server / ``LLM``) process; no connector instance exists
        there. Never: raise on names it does not know (they are summed like the others).
        """
        return KVBlendConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """One Prometheus Counter per ``PROM_COUNTERS`` entry (:class:`KVBlendPromMetrics`).

        When: once, when vLLM's Prometheus stat logger starts (``KVConnectorProm``). Where:
        the front-end process. Never: register a metric name twice in one registry.
        """
        return KVBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
