"""Connector hooks of vLLM whose defaults are wrong for kvblend, mixed into the connector.

vLLM 0.33 adds three sleep-mode hooks to 0.32's connector API, 0.34 three more hooks (issues
#21, #35; ``docs/vllm-versions.md`` lists every hook, who calls it, and what kvblend does with
it). Three optional hooks of all three versions, and 0.34's ``may_load_async``, have defaults
that do not fit a shared, best-effort chunk store; :class:`KVBlendHooksMixin` overrides them
(and documents why ``handle_preemptions`` has nothing to do). :class:`KVBlendHMAMixin` is vLLM's ``SupportsHMA`` for a single KV cache group;
:func:`refuse_unsupported` keeps the connector idle when a hybrid model gets several, and for
sliding-window attention shorter than the model's length.
:func:`skips_external_kv` names the requests vLLM computes whole, and :func:`resumed_req_ids` the
requests a step resumes (both differ between 0.33 and 0.34).

:class:`cluster.vllm.connector.KVBlendConnector` adopts both mixins::

    class KVBlendConnector(KVBlendHooksMixin, KVBlendHMAMixin, KVConnectorBase_V1): ...

:class:`KVBlendHooksMixin` reads the connector's ``connector_scheduler`` (with the
``cache_hits``, ``forget_stored_keys`` and ``may_load_async`` methods of
:class:`cluster.vllm.scheduler.KVBlendScheduler`), ``client``, ``namespace_digest`` and
``enabled``. Like every hook of the connector, none of these raises for the cache's sake.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvblend.connector")

#: Our tier names (``Segment.tier``, a lookup's ``ChunkMeta.tier``) -> vLLM's hit sources.
#: Redis and S3 are remote stores: vLLM's ``external_unspecified`` ("uninstrumented connector
#: or remote store", vllm/v1/metrics/cache_hit_source.py). A shard on another node is still
#: host memory or disk: tiers are named by medium.
TIER_SOURCES = {"gpu": CacheHitSource.DEVICE, "host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


def cache_hit_sources(claim_start: int, num_external_tokens: int,
                      hits: Iterable[tuple[int, int, str]]) -> dict[CacheHitSource, int]:
    """Split a claim's tokens by the tier that supplied them, as vLLM's hit metrics want.

    The claim is ``[claim_start, claim_start + num_external_tokens)``; each hit ``(start, end,
    tier)`` (prompt token indices) counts its overlap with it under ``TIER_SOURCES[tier]``.
    Claimed tokens no cached chunk covers (separators, the system prompt, missed segments
    that the blend computes) count as ``external_unspecified``::

        | sys | sep | chunk A (host) | sep | chunk B (disk) | query |
              ^claim_start                                  ^claim_start + n
              [unspec][  HOST      ][unsp][   DISK        ]

    Returns:
        Non-zero counts only, summing to ``num_external_tokens`` (``{}`` for 0), as
        ``KVConnectorBase_V1.get_external_cache_hit_sources`` requires.

    Raises:
        ValueError: ``num_external_tokens`` < 0, or hits that overlap each other.
    """
    if num_external_tokens < 0:
        raise ValueError(f"num_external_tokens={num_external_tokens} < 0")
    claim_end = claim_start + num_external_tokens
    out: dict[CacheHitSource, int] = {}
    covered, last_end = 0, None
    for start, end, tier in sorted(hits):
        if last_end is not None and start < last_end:
            raise ValueError(f"overlapping hits at token {start}")
        last_end = end
        n = max(0, min(end, claim_end) - max(start, claim_start))
        if n:
            source = TIER_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + n
            covered += n
    if num_external_tokens > covered:
        out[CacheHitSource.EXTERNAL_UNSPECIFIED] = (out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0)
                                                    + num_external_tokens - covered)
    return out


def clear_namespaces(client: Any, digests: list[str]) -> int | None:
    """Delete every chunk of ``digests`` from the store (host and disk, as ``kvblend clear
    --namespace``); shared tiers (Redis, S3) are left alone.

    * the Ray client (``CacheClient.clear``): on every shard;
    * the agent client (``AgentClient``, the connector's default): on every shard through
      its agent (``clear``), and its machine-local ``fallback``;
    * the machine-local client (``LocalCacheClient``): what its tier lists, as a shard does
      (``CacheShard.clear``): a tier that clears by namespace (a ``TierStack``) or one that
      lists its keys (host, disk).

    Returns:
        Chunks deleted (shards that do not answer are skipped), or None when some copies could
        not be reached (the caller warns).

    Raises:
        Whatever the client or tier raises (the caller logs it).
    """
    clear = getattr(client, "clear", None)
    if callable(clear):
        return sum(int(clear(digest)) for digest in digests)
    fallback = getattr(client, "fallback", None)
    if fallback is not None:
        deleted = clear_namespaces(fallback, digests)
        return None if getattr(client, "up", False) else deleted
    tier = getattr(client, "tier", None)
    if tier is not None and callable(getattr(tier, "clear", None)):
        return sum(int(tier.clear(digest)) for digest in digests)
    if tier is None or not callable(getattr(tier, "keys", None)) or not callable(getattr(client, "delete", None)):
        return None
    wanted = set(digests)
    keys = [k for k in tier.keys() if k.namespace in wanted]
    return int(client.delete(keys)) if keys else 0


class KVBlendHooksMixin:
    """``requires_kv_delivery``, ``get_external_cache_hit_sources``, ``reset_cache`` (vLLM 0.32,
    0.33 and 0.34) and ``may_load_async`` (0.34 only) for
    :class:`cluster.vllm.connector.KVBlendConnector`."""

    connector_scheduler: Any    # KVBlendScheduler (None in the worker role), with cache_hits()
    client: Any                 # the cache client, an AllRanksLookup (``digests``) under TP
    namespace_digest: str
    enabled: bool

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvblend is a best-effort cache (vLLM's default is True for ``kv_both``).

        When: read once, by ``Scheduler.__init__`` (scheduler process). True makes vLLM drop,
        and sample again, the in-flight tokens of every request it preempts under async
        scheduling (``Scheduler._preempt_request(drop_stale_output=True)``), to protect a
        hand-off that reads the request's blocks after the step. Ours never does: prefix
        chunks are gathered in the same step's ``wait_for_save`` and canonical segments are
        computed from token ids, so a preempted request's blocks are not read again.
        """
        return False

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Nothing: no KV of ours is in flight for a preempted request, so none can land in
        blocks vLLM hands to another request (vLLM's offloading connector flushes its async
        saves of the preempted blocks here).

        When: every worker step, before the forward, with the step's metadata. Where:
        worker, the model's thread. Why nothing, per kind of work:

        * async blends run only for requests in ``WAITING_FOR_REMOTE_KVS``, and vLLM preempts
          only running requests (``Scheduler._preempt_request`` asserts ``RUNNING``); an
          aborted one is abandoned and reported in ``finished_recving`` before vLLM frees
          its blocks;
        * synchronous loads (prefix chunks, ``kvblend_load_async=False``) run to the end in
          :meth:`start_load_kv` before the forward of the step that scheduled the request; a
          preemption comes in a later ``schedule()``, and workers run steps in order;
        * prefix chunks are gathered from the paged cache in :meth:`wait_for_save` of the
          step whose forward computed them; canonical segments are computed from token ids.

        A preempted request is asked :meth:`get_num_new_matched_tokens` again when resumed;
        its claim is loaded again into its new blocks (``test_hooks.py::
        test_preemption_under_memory_pressure_keeps_outputs``).
        """
        return

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's ``external_prefix_cache_hits`` by tier (``host``, ``disk``, the rest
        ``external_unspecified``; :func:`cache_hit_sources`). vLLM's default files every token
        under ``external_unspecified`` ("subclasses must set HOST/DISK/P2P or override").

        When: in ``Scheduler.schedule()``, right after :meth:`update_state_after_alloc` of a
        newly admitted request whose claim vLLM kept (``num_external_tokens`` > 0, not a
        preempted request), only when stats are logged. Where: scheduler process, busy-loop
        thread. Never: raise (any failure files everything as ``external_unspecified``).
        """
        if num_external_tokens <= 0:
            return {}
        try:
            claim_start, hits = self.connector_scheduler.cache_hits(request.request_id)
            return cache_hit_sources(claim_start, num_external_tokens, hits)
        except Exception as e:  # noqa: BLE001 - metrics never fail a request
            log.debug("kvblend: hit sources of %s unknown (%s: %s)", request.request_id, type(e).__name__, e)
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}

    def may_load_async(self, request: Request) -> bool:
        """Whether :meth:`get_num_new_matched_tokens` may answer ``load_kv_async=True`` for
        ``request``: a blend on vLLM's async-load path (``load_async``, the default;
        :meth:`cluster.vllm.scheduler.KVBlendScheduler.may_load_async` says how it is decided).
        vLLM's default answers True only for P/D ``do_remote_prefill`` requests, so no blend
        would start loading while the running batch is full.

        When: vLLM 0.34 with ``--max-num-inflight-kv-loads`` only, when a request enters the
        waiting queues (``Scheduler._enqueue_waiting_request``: on arrival, after
        ``on_new_request``, and a streaming session's next input; a preempted request goes back
        to the plain queue unasked). True puts it in vLLM's queue of async loads,
        whose head may start its load while the batch is full (parked in
        ``WAITING_FOR_REMOTE_KVS``, counted against the cap); a false positive holds back the
        loads behind it until a running slot frees. 0.32 and 0.33 never call it. Where:
        scheduler process, busy-loop thread. Never: raise, or look the cache up (any failure
        answers False: the request waits for a running slot, as under vLLM's default).
        """
        if not self.enabled or self.connector_scheduler is None:
            return False
        try:
            return bool(self.connector_scheduler.may_load_async(request))
        except Exception as e:  # noqa: BLE001 - a queue choice never fails a request
            log.debug("kvblend: may_load_async(%s) failed (%s: %s); False", getattr(request, "request_id", "?"),
                      type(e).__name__, e)
            return False

    def reset_cache(self) -> bool | None:
        """Delete this engine's namespaces from the shards (what ``kvblend clear --namespace``
        does) and forget which chunks this process already scheduled for storing; True when
        the shards were asked. Shared tiers (Redis, S3) and the workers' gpu tiers keep their
        copies: the log line says so.

        When: ``Scheduler.reset_prefix_cache(reset_connector=True)``, i.e. on every
        ``pause_generation(clear_cache=True)`` (the default), ``sleep(level >= 1)``,
        ``release_kv_cache_memory()`` (``EngineCore._reset_caches``) and
        ``LLM.reset_prefix_cache(reset_connector=True)`` / ``POST
        /reset_prefix_cache?reset_external=true``; around a weight update, so KV computed with
        the old weights must not be served afterwards (our namespace does not change with
        weights updated in place). Where: scheduler process, the engine core's thread, with
        the scheduler paused. Never: return False — ``EngineCore._reset_caches`` turns it into
        ``RuntimeError("Failed to reset the KV connector cache.")`` and pause/sleep fail;
        a store that cannot be cleared answers None (vLLM's "not implemented", taken as
        success) with a warning naming the command that clears it.
        """
        if not self.enabled or self.connector_scheduler is None:
            return True  # nothing of ours is cached by this connector
        digests = list(getattr(self.client, "digests", None) or [self.namespace_digest])
        try:
            self.connector_scheduler.forget_stored_keys()
            deleted = clear_namespaces(self.client, digests)
        except Exception as e:  # noqa: BLE001 - a reset never fails pause/sleep for the cache's sake
            log.warning("kvblend: reset_cache failed (%s: %s): chunks of namespace %s may outlive a "
                        "weight update; run `kvblend clear --namespace %s`", type(e).__name__, e,
                        self.namespace_digest, self.namespace_digest)
            return None
        if deleted is None:
            log.warning("kvblend: reset_cache: this cache client cannot clear the shards; chunks of "
                        "namespace %s stay there (run `kvblend clear --namespace %s`)",
                        self.namespace_digest, self.namespace_digest)
            return None
        log.info("kvblend: reset_cache deleted %d chunk(s) of namespace(s) %s from the shards; "
                    "Redis/S3 and the workers' gpu tiers were not cleared (`kvblend clear --shared`)",
                    deleted, ", ".join(digests))
        return True


def hybrid_refusal(kv_cache_config: KVCacheConfig | None) -> str | None:
    """Why kvblend cannot serve ``kv_cache_config`` (None: it can): the connector loads into
    and stores from one KV cache group; vLLM's hybrid KV cache manager makes one group per
    kind of layer (full attention, sliding window, Mamba) of a hybrid model."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) <= 1:
        return None
    kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
    return (f"the model has {len(groups)} KV cache groups ({kinds}) and kvblend handles one: "
            "start vLLM with --disable-hybrid-kv-cache-manager")


def sliding_window_refusal(model_config: Any) -> str | None:
    """Why kvblend cannot serve a model with sliding-window attention (None: it can).

    Stored chunks and the blend engine (:mod:`blend.attention`) assume full attention: a chunk's
    KV computed alone, or a blend's recomputed tokens, would attend further back than a layer of
    window ``w`` does, so reused KV would differ from what vLLM computes (wrong output, issue 21).
    A window at least ``max_model_len`` long never applies, so such a model is served as usual.
    ``model_config`` is vLLM's ``ModelConfig`` (``get_sliding_window()``, ``hf_text_config``'s
    ``layer_types``, ``max_model_len``)."""
    try:
        window = model_config.get_sliding_window()
    except Exception:  # noqa: BLE001 - a config vLLM itself could not read: not ours to refuse
        return None
    if isinstance(window, (list, tuple)):  # older configs: one window per layer
        windows = [int(w) for w in window if w]
        window = min(windows) if windows else None
    if not window:
        return None
    layer_types = getattr(getattr(model_config, "hf_text_config", None), "layer_types", None)
    if layer_types is not None and not any("sliding" in str(t) for t in layer_types):
        return None
    max_len = int(getattr(model_config, "max_model_len", 0) or 0)
    if max_len and int(window) >= max_len:
        return None
    return (f"the model uses sliding-window attention (window {int(window)} tokens < max_model_len "
            f"{max_len}) and kvblend's stored and blended KV assume full attention: no KV is loaded "
            "or stored (vLLM's own prefix caching still applies)")


def refuse_unsupported(model_config: Any, kv_cache_config: KVCacheConfig | None, role: KVConnectorRole) -> bool:
    """Whether the connector must stay idle: sliding-window attention
    (:func:`sliding_window_refusal`) or several KV cache groups (:func:`hybrid_refusal`). The
    scheduler's connector says why in one warning; the workers' stay silent, so an engine
    logs one line."""
    reason = sliding_window_refusal(model_config) or hybrid_refusal(kv_cache_config)
    if reason is None:
        return False
    if role == KVConnectorRole.SCHEDULER:
        log.warning("kvblend: %s; the connector stays idle", reason)
    return True


def resumed_req_ids(cached) -> Container[str]:
    """The ids a step's ``scheduled_cached_reqs`` names as resumed (their block lists start
    over). vLLM 0.32 and 0.33 name them in ``CachedRequestData.resumed_req_ids``; 0.34 dropped
    the field and sends resumed requests in ``scheduled_new_reqs`` instead (read from its
    wheel, not run), so there it is empty."""
    return getattr(cached, "resumed_req_ids", None) or ()


def skips_external_kv(request: Request) -> bool:
    """Whether vLLM throws away what the connector claims for ``request``; the scheduler half
    then claims nothing for it (:meth:`cluster.vllm.scheduler.KVBlendScheduler._plan_request`).

    vLLM asks the connector for every waiting request and then zeroes the answer of one it
    computes whole (``ext_tokens, load_kv_async = 0, False`` in ``Scheduler.schedule``): 0.32
    and 0.33 test ``request.skip_reading_prefix_cache`` (prompt logprobs, pooling), 0.34
    ``request.skip_reading_external_kv``, true whenever ``prefix_cache_hit_limit`` is set
    (prompt logprobs, from their first scored row; ``skip_reading_prefix_cache`` in the
    sampling or pooling params). Claiming nothing keeps the ``claim`` event honest and plans no
    blend for tokens vLLM refuses; the lookup still runs, because it decides which missed chunks
    the request stores (vLLM's offloading connectors also keep storing such requests).
    """
    return bool(getattr(request, "skip_reading_prefix_cache", False)
                or getattr(request, "skip_reading_external_kv", False))


class KVBlendHMAMixin(SupportsHMA):
    """vLLM's ``SupportsHMA`` for a connector that handles one KV cache group (adopted by
    :class:`cluster.vllm.connector.KVBlendConnector`, ``docs/vllm-versions.md``): vLLM keeps its
    hybrid KV cache manager on, models of one kind of attention layer still get one group, and
    hybrid models get several, for which the connector stays idle (:func:`refuse_unsupported` in
    its ``__init__``; ``--disable-hybrid-kv-cache-manager`` gives them one group and kvblend).

    Expects the connector's ``request_finished`` and ``enabled``.
    """

    enabled: bool

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` with the request's only group.

        When: exactly once per request, when it finishes or is aborted, before its blocks are
        freed; ``Scheduler._connector_finished`` calls it instead of ``request_finished`` when
        ``isinstance(connector, SupportsHMA)``, with one block-id list per KV cache group
        (``block_ids`` of the computed tokens). Where: scheduler process, busy-loop thread.

        Raises:
            RuntimeError: several groups reach a connector that is not idle (its ``__init__``
                must have refused them with :func:`hybrid_refusal`).
        """
        if len(block_ids) > 1 and self.enabled:
            raise RuntimeError(f"kvblend handles one KV cache group, got {len(block_ids)}: "
                               "the connector should have stayed idle (hybrid_refusal)")
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])
