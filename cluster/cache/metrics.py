"""Shard metrics through ``ray.util.metrics`` (Prometheus, scraped from each Ray node's agent).

Every metric is named ``kvblend_*`` here; Ray's exporter prefixes ``ray_`` and adds
``_total`` to counters, so Prometheus sees e.g. ``ray_kvblend_hits_total``. Tags: ``shard``
(actor name) and, where it applies, ``tier`` (host, disk, redis, s3) and ``state`` (a tier
breaker's new state: open, half_open, closed).

The fault metrics (issue #20) are emitted where the shard counts the same-named counters of
its ``stats()``: ``kvblend_writes_dropped`` (:mod:`cluster.cache.shard`),
``kvblend_lookup_timeouts`` (per shard only: where it is counted a late key's tier is
unknown), ``kvblend_breaker_transitions`` (per tier and new state) and the gauge
``kvblend_breaker_open`` (1 while open or half-open, 0 when closed and from the breaker's
creation; both :mod:`cluster.cache.deadline`).

The Grafana dashboard ``cluster/grafana/kvblend.json`` queries only names from
:func:`prometheus_names` (a subset of them; ``tests/cluster/cache/test_metrics.py`` checks
that, and that a live scrape has every name the dashboard queries).

Failure behaviour: metrics never raise into the data path; when ``ray.util.metrics`` cannot
be used (metrics disabled in config) every call is a no-op.
"""

from __future__ import annotations

import threading

#: Latency buckets in milliseconds (lookups are sub-ms on a node, cross-node reads ~ms).
LATENCY_BUCKETS_MS = [0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000]

# name -> (kind, description, tag keys)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "kvblend_hits": ("counter", "chunks found, per tier that answered", ("shard", "tier")),
    "kvblend_misses": ("counter", "chunks found in no tier", ("shard",)),
    "kvblend_bytes_in": ("counter", "bytes written into a tier", ("shard", "tier")),
    "kvblend_bytes_out": ("counter", "bytes read out of a tier", ("shard", "tier")),
    "kvblend_evictions": ("counter", "chunks evicted from a tier", ("shard", "tier")),
    "kvblend_read_errors": ("counter", "corrupted, truncated or foreign objects read (served as misses)", ("shard", "tier")),
    "kvblend_writes_dropped": ("counter", "write-downs to lower tiers dropped: the shard's write backlog was full", ("shard",)),
    "kvblend_lookup_timeouts": ("counter", "lower-tier header reads that missed lookup_timeout_s (served as misses)", ("shard",)),
    "kvblend_oversized": ("counter", "whole-object reads of values longer than the object their header describes or max_object_mib (served as misses, never read)", ("shard", "tier")),
    "kvblend_io_timeouts": ("counter", "disk calls that ran past io_timeout_s (the tier was stalled meanwhile)", ("shard", "tier")),
    "kvblend_io_refused": ("counter", "disk calls refused as misses while a call ran past io_timeout_s", ("shard", "tier")),
    "kvblend_breaker_transitions": ("counter", "tier breaker state changes, by new state", ("shard", "tier", "state")),
    "kvblend_prefetch_started": ("counter", "promotions into host memory started by a lookup", ("shard",)),
    "kvblend_prefetch_hits": ("counter", "reads served from host memory that a prefetch had promoted", ("shard",)),
    "kvblend_lookup_latency_ms": ("histogram", "shard-side batch lookup time, ms", ("shard",)),
    "kvblend_get_latency_ms": ("histogram", "shard-side get (object ref) time, ms", ("shard",)),
    "kvblend_bytes_used": ("gauge", "bytes stored in a tier", ("shard", "tier")),
    "kvblend_capacity_bytes": ("gauge", "byte capacity of a tier", ("shard", "tier")),
    "kvblend_chunks": ("gauge", "chunks stored in a tier", ("shard", "tier")),
    "kvblend_breaker_open": ("gauge", "1 while a tier's breaker is open or half-open, 0 when closed", ("shard", "tier")),
}


def prometheus_name(name: str) -> str:
    """The name Prometheus sees for one of :data:`METRICS` (Ray adds ``ray_``, ``_total``)."""
    kind = METRICS[name][0]
    return f"ray_{name}_total" if kind == "counter" else f"ray_{name}"


def prometheus_names() -> set[str]:
    """Every series name the shards emit (histograms add _bucket/_sum/_count)."""
    out = set()
    for name, (kind, _, _) in METRICS.items():
        base = prometheus_name(name)
        if kind == "histogram":
            out.update({f"{base}_bucket", f"{base}_sum", f"{base}_count"})
        else:
            out.add(base)
    return out


#: tier ``stats()`` counters published as ``kvblend_<name>`` counters by :meth:`ShardMetrics.tier_stats`
_TIER_COUNTERS = ("evictions", "io_timeouts", "io_refused", "oversized")


class ShardMetrics:
    """The metrics of one shard actor (tag ``shard`` fixed to its name).

    Args:
        shard: the actor name.
        enabled: False makes every method a no-op.
    """

    def __init__(self, shard: str, enabled: bool = True) -> None:
        self.shard = shard
        self.enabled = enabled
        self._m: dict[str, object] = {}
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        if not enabled:
            return
        from ray.util import metrics as rm

        for name, (kind, doc, tags) in METRICS.items():
            if kind == "counter":
                m = rm.Counter(name, description=doc, tag_keys=tags)
            elif kind == "gauge":
                m = rm.Gauge(name, description=doc, tag_keys=tags)
            else:
                m = rm.Histogram(name, description=doc, boundaries=LATENCY_BUCKETS_MS, tag_keys=tags)
            m.set_default_tags({"shard": shard})
            self._m[name] = m

    @staticmethod
    def _tags(tier: str | None, state: str | None) -> dict[str, str] | None:
        tags = {k: v for k, v in (("tier", tier), ("state", state)) if v}
        return tags or None

    def inc(self, name: str, value: float = 1.0, tier: str | None = None,
            state: str | None = None) -> None:
        """Add ``value`` to counter ``name`` (tags ``tier``/``state`` where given)."""
        if not self.enabled or value <= 0:
            return
        try:
            self._m[name].inc(value, tags=self._tags(tier, state))
        except Exception:  # noqa: BLE001 - metrics must never break the data path
            pass

    def set(self, name: str, value: float, tier: str | None = None) -> None:
        """Set gauge ``name`` (tag ``tier`` where given)."""
        if not self.enabled:
            return
        try:
            self._m[name].set(float(value), tags=self._tags(tier, None))
        except Exception:  # noqa: BLE001
            pass

    def observe(self, name: str, value_ms: float) -> None:
        if not self.enabled:
            return
        try:
            self._m[name].observe(value_ms)
        except Exception:  # noqa: BLE001
            pass

    def tier_stats(self, tier: str, stats: dict[str, float]) -> None:
        """Publish a tier's ``stats()``: gauges, and the deltas of :data:`_TIER_COUNTERS`
        (evictions; the disk's ``io_timeouts``/``io_refused``; Redis's and S3's ``oversized``)
        as counters."""
        if not self.enabled:
            return
        try:
            tags = {"tier": tier}
            self._m["kvblend_bytes_used"].set(float(stats.get("bytes_used", 0)), tags=tags)
            self._m["kvblend_capacity_bytes"].set(float(stats.get("capacity_bytes", 0)), tags=tags)
            self._m["kvblend_chunks"].set(float(stats.get("num_chunks", 0)), tags=tags)
            for counter in _TIER_COUNTERS:
                with self._lock:
                    now = float(stats.get(counter, 0))
                    delta = now - self._last.get((tier, counter), 0.0)
                    self._last[(tier, counter)] = now
                if delta > 0:
                    self._m[f"kvblend_{counter}"].inc(delta, tags=tags)
        except Exception:  # noqa: BLE001
            pass
