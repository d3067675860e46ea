"""The connector's worker half: produce claimed KV into vLLM's paged cache, and store KV.

Runs in each vLLM worker, on the thread that runs the model (the only thread that may: vLLM's
CPU ops are not thread-safe). Each engine step it receives the scheduler half's
:class:`~cluster.vllm.metadata.KVBlendConnectorMetadata`:

* **Blend loads**: :class:`blend.engine.BlendEngine` over the model of
  :func:`blend.adapters.vllm.vllm_adapter` (the fused Llama layers over vLLM's weights, the
  code ``kvblend bench gpu`` times; vLLM's modules for other models) and
  :class:`cluster.vllm.worker_source.WorkerKVSource` (the worker's gpu tier of ``gpu_size_gib``
  in front of the cache client); each layer's final KV is written at the request's slots by the
  attention backend's own ``do_kv_cache_update`` (:mod:`cluster.vllm.paged` is the plain-torch
  reference). On vLLM's async-load path the blend advances a few layers per engine step
  (:meth:`blend.engine.BlendEngine.blend_steps`) for about ``load_step_s`` seconds after the
  step's forward (all of it in a step with nothing else scheduled), and is reported done in
  ``get_finished``'s ``finished_recving``; synchronous loads run to the end before the forward.
* **Prefix loads**: exact chunks, each layer fetched and written at its slots (synchronous).
* **Failures**: the claimed KV is recomputed by full prefill through the same adapter; if even
  that fails, its blocks are reported by ``get_block_ids_with_load_errors``. Never partial KV:
  the last write per layer wins and every claimed slot is written.
* **Stores**: prefix chunks are gathered from the paged cache after their forward; canonical
  segments are queued; both go through :class:`cluster.vllm.store_queue.StoreQueue`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from blend.cost import kv_bytes_per_token
from blend.engine_select import QUERY_SELECTIONS
from cluster.heap import HeapTrimmer
from cluster.vllm import paged
from cluster.vllm.affinity import unpin_thread
from cluster.vllm.cost_samples import CostSamples, samples_of
from cluster.vllm.events import EventLog, WarnOnce
from cluster.vllm.metadata import KVBlendConnectorMetadata, LoadSpec, StoreSpec
from cluster.vllm.metrics import Counters
from cluster.vllm.store_queue import StoreQueue
from cluster.vllm.worker_engine import build_worker_engine

log = logging.getLogger("kvblend.connector")


@dataclass
class _LoadRun:
    """One blend load in flight (async: advanced a slice per engine step)."""

    spec: LoadSpec
    record: dict[str, Any]
    steps: Any                  # BlendEngine.blend_steps generator
    #: the blend's per-layer callback: writes the claimed rows into vLLM's cache and keeps
    #: whether they were finite (checked once, when the blend ends; non-finite: full prefill)
    on_layer: paged.ClaimedLayerWrites
    start_s: float
    num_engine_steps: int = 0   # engine steps it ran in
    busy_steps: int = 0         # of those, steps that also ran other requests' forward
    #: keys of the plan's hits the worker's gpu tier held when the load began (no transfer)
    gpu_held: set = field(default_factory=set)


class KVBlendWorker:
    """The worker half of :class:`cluster.vllm.connector.KVBlendConnector`.

    Args:
        config: the effective :class:`cluster.config.KVBlendConfig` (``tiers.gpu_size_gib``,
            ``cluster.call_timeout_s`` are read).
        client: this rank's cache client (None: the connector is idle).
        model_id: the namespace's model id (the adapter's).
        store_tokens_per_step, load_step_s: see :mod:`cluster.vllm.options`.
        counters, events, warn: where loads and stores are reported.
    """

    def __init__(self, config, client, *, model_id: str, store_tokens_per_step: int, load_step_s: float,
                 counters: Counters, events: EventLog, warn: WarnOnce) -> None:
        self.config = config
        self.client = client
        self.model_id = model_id
        self.store_tokens_per_step = store_tokens_per_step
        self.load_step_s = load_step_s
        self._counters = counters
        self._events = events
        self._warn = warn
        self._kv_caches: dict[int, tuple[str, torch.Tensor]] = {}
        self._layout: str | None = None
        self._engine = None
        self._engine_lock = threading.Lock()
        self._source = None  # WorkerKVSource: the worker's gpu tier in front of the client
        self._invalid_block_ids: set[int] = set()
        self._arena_reported = {"arena_bytes": 0, "arena_used_bytes": 0, "arena_full": 0}
        self._loads: OrderedDict[str, _LoadRun] = OrderedDict()  # async loads in flight
        self._recv_done: set[str] = set()    # async loads done (finished_recving)
        self._cost_samples = CostSamples()   # for the scheduler's cost estimates (issue 34)
        # freed heap back to the OS after requests finish (also once the worker went idle)
        self._heap = HeapTrimmer(on_trim=lambda s: counters.bump(heap_trims=1, heap_trim_s=s))
        self.stores = StoreQueue(client, canonical_kv=self._canonical_kv,
                                 remember=lambda key, kv: self._source.remember(key, kv),
                                 counters=counters, events=events, warn=warn, thread_initializer=unpin_thread)

    def _engine_for_worker(self):
        """The blend engine over the model vLLM built in this process (built on first use, with
        the worker's KV source: :func:`cluster.vllm.worker_engine.build_worker_engine`)."""
        with self._engine_lock:
            if self._engine is None:
                engine, self._source, samples = build_worker_engine(self.config, self.client, self.model_id)
                self._cost_samples = self._cost_samples.merge(samples)
                self._engine = engine
            return self._engine

    def _canonical_kv(self, ids: list[int]) -> torch.Tensor:
        """KV of ``ids`` alone at positions ``0..n-1``, ``[L, 2, T, H, D]`` on the CPU."""
        with torch.inference_mode():
            result = self._engine_for_worker().prefill(ids, want_logits=False)
        self._sample_costs(result.counters, len(ids))
        return torch.stack(result.kv).cpu()  # [L, 2, T, H, D]

    def _sample_costs(self, c, keys: int, plan=None, local=()) -> None:
        """What one blend or prefill measured, for the scheduler half's cost estimates
        (:func:`cluster.vllm.cost_samples.samples_of`; ``local``: keys the gpu tier held)."""
        engine = self._engine
        per_token = kv_bytes_per_token(engine.spec, engine.model.dtype.itemsize) if plan is not None else 0
        self._cost_samples = self._cost_samples.merge(samples_of(c, keys, plan, per_token, local))

    def take_cost_samples(self) -> CostSamples | None:
        """The samples since the last call (None when none), for vLLM's worker metadata."""
        out, self._cost_samples = self._cost_samples, CostSamples()
        return out or None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Index vLLM's per-layer caches by layer number and detect their layout."""
        from vllm.platforms import current_platform

        for name, cache in kv_caches.items():
            m = re.search(r"layers\.(\d+)\.", name)
            if m is None or not isinstance(cache, torch.Tensor):
                continue
            self._kv_caches[int(m.group(1))] = (name, cache)
            if self._layout is None:
                self._layout = paged.detect_layout(cache, current_platform.is_cpu())
        if not current_platform.is_cpu() and self.client is not None:
            try:  # compile, capture and calibrate now, at start-up, not in the first request
                self._engine_for_worker()
            except Exception as e:  # noqa: BLE001 - never fail vLLM's start for the cache's sake
                log.warning("building the blend engine at start-up failed (%s: %s); the first blend "
                            "builds it", type(e).__name__, e)

    # ------------------------------------------------------------------ loads

    def start_load_kv(self, meta: KVBlendConnectorMetadata, layers: dict) -> None:
        """Start this step's loads (sync ones run to the end); advance the async ones.

        Args:
            meta: this step's metadata.
            layers: vLLM's attention layers by name (``forward_context.no_compile_layers``).
        """
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
        on_layer = paged.ClaimedLayerWrites(
            start, end, spec.slot_mapping, lambda i, kv, slots: self._write_layer(layers, i, kv, slots))
        record: dict[str, Any] = {"request_id": spec.request_id, "load_start": start, "load_end": end,
                                  "load_async": spec.load_async}
        run = _LoadRun(spec, record, None, on_layer, start_s)
        try:
            if spec.plan is None:
                self._load_prefix(spec, layers)
                record.update(path="prefix", num_prefix_chunks=len(spec.prefix), fallback=False)
                self._counters.bump(prefix_requests=1)
            else:
                engine = self._engine_for_worker()
                run.gpu_held = self._source.gpu_held([seg.key for seg in spec.plan.hit_segments])
                record["gpu_hit_segments"] = len(run.gpu_held)
                self._counters.bump(gpu_hit_segments=record["gpu_hit_segments"])
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
                        if not run.on_layer.all_finite():  # the blend's one host sync
                            raise RuntimeError("non-finite KV in a claimed layer") from None
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
        self._sample_costs(c, run.spec.plan.blend_end, run.spec.plan, local=run.gpu_held)
        run.record.update(path="blend", num_segments=c.num_segments, num_hit_segments=c.num_hit_segments,
                          reused_tokens=c.reused_tokens, computed_tokens=c.computed_tokens,
                          selected_tokens=c.selected_tokens, selection=c.selection,
                          selection_fallback=c.selection_fallback, probe_s=c.probe_s,
                          recomputed_tokens_per_layer=c.recomputed_tokens_per_layer,
                          load_wait_s=c.load_wait_s, compute_s=c.compute_s, transfer_s=c.transfer_s,
                          transfer_busy_s=c.transfer_busy_s,
                          full_prefill_reason=c.full_prefill_reason, lost_segments=c.lost_segments,
                          fallback=c.full_prefill_reason is not None)
        self._counters.bump(blend_requests=1, segments=c.num_segments, hit_segments=c.num_hit_segments,
                            reused_tokens=c.reused_tokens, selected_tokens=c.selected_tokens,
                            computed_tokens=c.computed_tokens, load_wait_s=c.load_wait_s,
                            query_selections=int(c.selection in QUERY_SELECTIONS and c.full_prefill_reason is None),
                            selection_fallbacks=int(c.selection_fallback is not None), probe_s=c.probe_s,
                            lost_segments=c.lost_segments)
        if c.full_prefill_reason is not None:
            self._counters.bump(fallbacks=1)
        self._report_arena()

    def _report_arena(self) -> None:
        """The agent arena's size and use (gauges) and its full-arena misses since the last
        report, as deltas (no call to the agent: the client's own numbers)."""
        arena = getattr(self.client, "arena_stats", lambda: None)()  # over a cache agent only
        if arena is None:
            return
        now = {**arena, "arena_full": self.client.counters.get("arena_full", 0)}
        deltas = {k: now[k] - old for k, old in self._arena_reported.items() if now[k] != old}
        self._arena_reported = {k: now[k] for k in self._arena_reported}
        if deltas:
            self._counters.bump(**deltas)

    def _load_failed(self, run: _LoadRun, e: Exception) -> None:
        """Recompute the claimed KV by full prefill through the same adapter; if even that
        fails, report the claimed blocks to vLLM (``get_block_ids_with_load_errors``)."""
        spec, record = run.spec, run.record
        self._warn("load", "kvblend: load of request %s failed (%s: %s); recomputing by "
                   "full prefill", spec.request_id, type(e).__name__, e)
        log.debug("kvblend load failure", exc_info=True)
        self._counters.bump(fallbacks=1)
        record.update(fallback=True, error=f"{type(e).__name__}: {e}")
        try:
            run.on_layer.reset()  # the prefill's own layers, checked once at its end
            with torch.inference_mode():
                self._engine_for_worker().prefill(list(spec.token_ids[:spec.load_end]), want_logits=False,
                                                  on_layer=run.on_layer)
            if not run.on_layer.all_finite():
                raise RuntimeError("non-finite KV from full prefill")
            record["recovered_by"] = "full_prefill"
        except Exception as e2:  # noqa: BLE001
            self._warn("load2", "kvblend: full prefill of request %s failed too (%s: %s); "
                       "reporting its blocks to vLLM", spec.request_id, type(e2).__name__, e2)
            self._counters.bump(load_errors=1)
            record["recovered_by"] = "vllm"
            bs = spec.block_size
            self._invalid_block_ids.update(spec.block_ids[t // bs] for t in range(spec.load_start, spec.load_end))

    def _end_load(self, run: _LoadRun) -> None:
        run.record.update(wall_s=time.perf_counter() - run.start_s, engine_steps=run.num_engine_steps,
                          busy_steps=run.busy_steps)
        self._events.write("load", **run.record)

    def _load_prefix(self, spec: LoadSpec, layers: dict) -> None:
        """Exact prefix chunks: each layer of every chunk, written at its slots.

        Every layer is asked for at once; each is waited for at most ``load_timeout_s`` once
        this loop reaches it (the blend engine's rule, issue 20). A layer not delivered by
        then, or unreadable, raises ``RuntimeError`` and the caller recomputes the request by
        full prefill (the read is cancelled)."""
        keys = [k for k, _, _ in spec.prefix]
        num_layers = len(self._kv_caches)
        timeout_s = self.config.blend.load_timeout_s
        futures = self.client.fetch_layers(keys, list(range(num_layers)))
        for layer_idx, fut in enumerate(futures):
            try:
                got = fut.result(timeout=timeout_s)
            except TimeoutError:
                for f in futures[layer_idx:]:
                    f.cancel()
                raise RuntimeError(f"prefix chunk layer {layer_idx} not delivered within "
                                   f"load_timeout_s={timeout_s:g} s") from None
            if any(t is None for t in got):
                raise RuntimeError(f"prefix chunk layer {layer_idx} unreadable")
            kv = torch.cat(list(got), dim=1)  # [2, hits * chunk_size, H, D]
            self._write_layer(layers, layer_idx, kv[:, spec.load_start:spec.load_end], spec.slot_mapping)

    # ------------------------------------------------------------------ stores and completion

    def wait_for_save(self, meta: KVBlendConnectorMetadata) -> None:
        """Drain store work queued by earlier steps (bounded), then queue this step's.

        Canonical segments are computed here (:meth:`StoreQueue.drain`), never in the step
        that computes their own request's prompt. Prefix chunks are gathered from the paged
        cache now (their blocks may be reused later) and put by the I/O thread.
        """
        # a step that computes a prompt, or whose async loads a request waits for, computes no
        # stores (unless they waited STORE_MAX_DEFER_S): they would delay a first token
        busy = meta.has_prefill or bool(self._loads) or bool(self._recv_done)
        self.stores.drain(busy, self.store_tokens_per_step)
        now = time.monotonic()
        for spec in meta.stores:
            if spec.prefix:
                self.stores.put_prefix(spec.request_id, self._gather_prefix(spec))
            if spec.segments:
                self.stores.add(spec.request_id, spec.segments, now)

    def _gather_prefix(self, spec: StoreSpec) -> list[tuple[Any, torch.Tensor]]:
        """``(key, kv[L, 2, T, H, D])`` of each prefix chunk of ``spec`` read from the paged
        cache; a chunk that cannot be read is skipped (warned once)."""
        prefix = []
        for key, slots in spec.prefix:
            try:
                kv = torch.stack([paged.gather_kv(self._kv_caches[i][1], self._layout, slots)
                                  for i in range(len(self._kv_caches))])  # [L, 2, T, H, D]
                prefix.append((key, kv))
            except Exception as e:  # noqa: BLE001
                self._warn("gather", "kvblend: prefix store skipped (%s: %s)", type(e).__name__, e)
        return prefix

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``finished_sending``: requests whose blocks ``request_finished`` held and whose
        canonical segments are all computed (their puts continue on the I/O thread).
        ``finished_recving``: async loads done, or abandoned because vLLM finished (aborted)
        the request meanwhile. When a request finished or a load ended, the freed heap goes
        back to the OS (:mod:`cluster.heap`: at most every few seconds, and once more when
        the interval ends, so an idle worker holds no freed heap)."""
        for rid in set(finished_req_ids) & set(self._loads):
            run = self._loads.pop(rid)
            run.steps.close()
            run.record.update(aborted=True)
            self._end_load(run)
            self._recv_done.add(rid)
        done = self.stores.finished_sending(finished_req_ids)
        recving, self._recv_done = self._recv_done, set()
        if finished_req_ids or recving:  # their buffers were freed: give the pages back
            self._heap.request()
        return (done or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose claimed KV could not be produced since the last call (then cleared)."""
        out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Compute every queued store and wait for the puts. Call it only where vLLM is not
        running the model (the worker's own thread: :meth:`shutdown`)."""
        return self.stores.flush(timeout_s)

    def shutdown(self) -> None:
        """Abandon async loads, compute and put what is queued (30 s at most), stop the I/O thread."""
        for run in self._loads.values():
            run.steps.close()
        self._loads.clear()
        try:
            self.flush(timeout_s=30.0)
        finally:
            self._heap.close()
            self.stores.shutdown()
            if self._source is not None:
                self._source.close()  # staging threads, pinned memory
