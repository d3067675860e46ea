"""The connector's counters, and how they reach vLLM's ``/metrics``.

Each connector counts into one :class:`Counters` (cumulative totals, and deltas since vLLM last
asked). vLLM collects the deltas every engine step from both roles
(``get_kv_connector_stats`` -> :class:`KVBlendConnectorStats`, summed across the workers and
the scheduler by ``aggregate``), ships them to the front end, and hands them to
:class:`KVBlendPromMetrics`, which exports each name of :data:`PROM_COUNTERS` as the Prometheus
counter ``vllm:kvblend_<name>_total``, labelled per engine like vLLM's own. vLLM's
``vllm:external_prefix_cache_hits_total`` counts the tokens the connector claimed.

Counters reach ``/metrics`` only with an engine step: the store counters (``stored_*``,
``store_*``) are bumped on the worker's I/O thread when a put finishes, so a put that finishes
after an idle engine's last step shows up with the next request's step. The cluster's own
count of accepted puts (``kvblend status --json``, every shard's ``counters.puts``) has no
such lag.

``KVConnectorStats`` is vLLM's term for such a batch of deltas; the connector's per-request
JSON lines are :mod:`cluster.vllm.events`, a different thing.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

#: counter -> help text; exported on vLLM's /metrics as ``vllm:kvblend_<name>`` (Counter,
#: ``_total`` suffix) by :class:`KVBlendPromMetrics`.
PROM_COUNTERS: dict[str, str] = {
    "requests": "requests the connector looked up",
    "ignored_overrides": "requests whose kvblend_* kv_transfer_params were ignored (allow_request_overrides off)",
    "uncacheable_requests": "requests not cached: multimodal inputs, prompt embeddings or an unreadable LoRA adapter",
    "blend_requests": "requests blended (CacheBlend path)",
    "prefix_requests": "requests served by exact prefix chunks",
    "segments": "chunk segments of blended requests",
    "hit_segments": "chunk segments read from the cache",
    "gpu_hit_segments": "of those, segments the worker's gpu tier held",
    "claimed_tokens": "prompt tokens the connector produced instead of vLLM",
    "reused_tokens": "tokens whose cached KV was reused",
    "selected_tokens": "reused tokens recomputed (selected at the check layer, or by query attention)",
    "query_selections": "blends whose reused tokens were chosen by the query's attention (query_attention, query_k_deviation)",
    "selection_fallbacks": "blends asked for a query selection without a query segment (ranked by K deviation)",
    "probe_s": "seconds spent in the query-attention probe (part of the blend)",
    "computed_tokens": "tokens computed in every layer (prefix, separators, misses)",
    "load_wait_s": "seconds the blend engine waited for cached KV",
    "fallbacks": "requests computed by full prefill after a cache or blend failure",
    "lost_segments": "hit chunks missing at their first read, computed instead (the request was blended without them)",
    "load_errors": "requests whose KV the connector could not produce (vLLM recomputed them)",
    "stored_chunks": "chunks stored",
    "stored_tokens": "tokens stored",
    "store_skipped": "chunks not stored because already cached",
    "store_dropped": "chunks not stored because the store queue was full (serving never waits)",
    "store_s": "seconds spent computing and storing chunks",
    "heap_trims": "times the worker handed freed heap back to the OS after requests finished (malloc_trim)",
    "heap_trim_s": "seconds those trims took (on the model's thread between engine steps; a trailing one on a timer thread)",
    "arena_full": "chunk objects not read because the cache agent's shared-memory arena had no room (misses)",
}
#: counter -> help text, one series per tier (label ``tier``): ``vllm:kvblend_<name>_total``;
#: counted as ``"<name>:<tier>"`` (issue 34: what the cost-aware plan chose, per tier)
PROM_TIER_COUNTERS: dict[str, str] = {
    "cost_loaded_chunks": "hit chunks the cost-aware plan loaded, by the tier that held them",
    "cost_recomputed_chunks": "hit chunks the cost-aware plan recomputed instead (loading was priced slower), by tier",
}
#: gauge -> help text: ``vllm:kvblend_<name>`` (Gauge, summed over the workers); they travel as
#: deltas like the counters (the worker bumps the change since its last report)
PROM_GAUGES: dict[str, str] = {
    "arena_bytes": "bytes of the cache agents' shared-memory arenas (agent_arena_gib per worker)",
    "arena_used_bytes": "bytes of those arenas holding chunk objects (read, or being read)",
}


class Counters:
    """One connector's counters (names of :data:`PROM_COUNTERS`), thread-safe: the worker's
    I/O thread counts stores while the worker thread counts loads.

    ``totals`` holds the cumulative values (``KVBlendConnector.counters``);
    :meth:`take_interval` returns and resets the deltas since its last call.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys([*PROM_COUNTERS, *PROM_GAUGES], 0)
        self._interval: dict[str, float] = {}
        self._lock = threading.Lock()

    def bump(self, **deltas: float) -> None:
        """Add ``deltas`` (name -> amount) to the totals and to the current interval.

        Raises:
            KeyError: a name not in :data:`PROM_COUNTERS` or :data:`PROM_GAUGES`, nor
                ``"<name>:<tier>"`` of :data:`PROM_TIER_COUNTERS` (our own bug).
        """
        with self._lock:
            for name, value in deltas.items():
                if name not in self.totals:
                    if name.partition(":")[0] not in PROM_TIER_COUNTERS or ":" not in name:
                        raise KeyError(name)
                    self.totals[name] = 0
                self.totals[name] += value
                self._interval[name] = self._interval.get(name, 0) + value

    def take_interval(self) -> dict[str, float]:
        """Deltas since the previous call (``{}`` when nothing was counted)."""
        with self._lock:
            data, self._interval = self._interval, {}
        return data


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
        self._tier_counters = {name: self._counter_cls(name=f"vllm:kvblend_{name}", documentation=f"kvblend: {doc}",
                                                       labelnames=[*labelnames, "tier"])
                               for name, doc in PROM_TIER_COUNTERS.items()}
        self._labelvalues = per_engine_labelvalues
        self._gauges, self._levels = {}, {}
        for name, doc in PROM_GAUGES.items():
            gauge = self._gauge_cls(name=f"vllm:kvblend_{name}", documentation=f"kvblend: {doc}",
                                    labelnames=labelnames, multiprocess_mode="mostrecent")
            self._gauges[name] = {idx: gauge.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            base, _, tier = name.partition(":")
            if tier and base in self._tier_counters and engine_idx in self._labelvalues and value > 0:
                self._tier_counters[base].labels(*self._labelvalues[engine_idx], tier).inc(value)
                continue
            per_engine = self._counters.get(name)
            if per_engine is not None and engine_idx in per_engine and value > 0:
                per_engine[engine_idx].inc(value)
            gauges = self._gauges.get(name)
            if gauges is not None and engine_idx in gauges and value:
                level = self._levels[(name, engine_idx)] = self._levels.get((name, engine_idx), 0) + value
                gauges[engine_idx].set(level)
