"""The vLLM worker's blend engine, built once in the worker's process: model, KV source and the
start-up work that keeps compiles and captures out of requests.

:func:`build_worker_engine` is called by :meth:`cluster.vllm.worker.KVBlendWorker._engine_for_worker`
the first time the worker needs its engine (when it registers vLLM's KV caches, at start-up, or
at its first blend or canonical prefill). In order:

1. the model adapter over the model vLLM built in this process
   (:func:`blend.adapters.vllm.vllm_adapter`: the fused Llama layers over vLLM's weights, the
   code ``kvblend bench gpu`` times), its layers compiled when ``blend.compile_layers`` is on
   and the model is on CUDA;
2. the worker's KV source (:func:`cluster.vllm.worker_source.build_worker_source`: the gpu tier
   of ``tiers.gpu_size_gib`` and the pinned store in front of the cache client);
3. on CUDA only: FlexAttention's shapes up to ``blend.flex_warm_tokens`` keys
   (:func:`blend.flex_rows.prepare_flex`), then the query probe's CUDA graphs up to
   ``blend.probe_graph_tokens`` (:class:`blend.probe_graphs.ProbeGraphs`), then the cost
   estimates' calibration prefills (:func:`cluster.vllm.cost_samples.calibration_samples`).
   The compile and the calibration run under ``torch.inference_mode`` as the worker's blends
   do (compiled code is guarded by the mode); the capture runs with gradients off. A failed calibration is logged and never stops vLLM; any other failure
   closes the source it built and raises.
"""

from __future__ import annotations

import logging

import torch

from cluster.vllm.cost_samples import CostSamples, calibration_samples

log = logging.getLogger("kvblend.connector")

__all__ = ["build_probe_graphs", "build_worker_engine"]


def build_worker_engine(config, client, model_id: str):
    """The worker's :class:`blend.engine.BlendEngine`, its source and the start-up cost samples.

    Args:
        config: the effective :class:`cluster.config.KVBlendConfig` (``blend``, ``tiers``).
        client: this rank's cache client.
        model_id: the namespace's model id (the adapter's).

    Returns:
        ``(engine, source, samples)``: the engine, its
        :class:`~cluster.vllm.worker_source.WorkerKVSource` and the calibration's
        :class:`~cluster.vllm.cost_samples.CostSamples` (empty off CUDA or when it failed).
    """
    from blend.adapters.vllm import vllm_adapter
    from blend.engine import BlendEngine
    from cluster.vllm.model_hook import current_model
    from cluster.vllm.worker_source import build_worker_source

    model = current_model()
    on_cuda = next(model.parameters()).is_cuda
    adapter = vllm_adapter(model, model_id=model_id, compile=config.blend.compile_layers and on_cuda)
    if getattr(adapter, "compiled", False):
        log.info("compiled the fused layers in %.1f s", adapter.warm_up())
    source = build_worker_source(
        client, adapter.device, adapter.spec.num_layers,
        gpu_bytes=int(config.tiers.gpu_size_gib * 2**30),
        policy=config.tiers.eviction_policy,
        pinned_bytes=int(config.tiers.pinned_size_gib * 2**30))
    try:
        engine = BlendEngine(adapter, source, load_timeout_s=config.blend.load_timeout_s)
        if on_cuda:
            _prepare_flex(config, adapter, engine.scale)
            graph_tokens = min(config.blend.probe_graph_tokens, adapter.spec.max_position or 2**31)
            engine.probe_graphs = build_probe_graphs(config.blend, adapter, engine.scale, graph_tokens)
    except BaseException:  # e.g. out of memory in the compile: the source's threads and pinned memory go
        source.close()
        raise
    samples = CostSamples()
    if on_cuda:
        try:  # the cost estimates' row rate, off the launch-bound floor (issue 34)
            with torch.inference_mode():
                samples = calibration_samples(engine, adapter.spec.max_position or 0)
        except Exception as e:  # noqa: BLE001 - the estimates then learn from requests only
            log.warning("the cost calibration's prefills failed (%s: %s)", type(e).__name__, e)
    return engine, source, samples


def _prepare_flex(config, adapter, scale: float) -> None:
    """FlexAttention's shapes compiled now for prompts up to ``blend.flex_warm_tokens``, before
    the probe's graphs capture any; nothing at 0."""
    tokens = min(config.blend.flex_warm_tokens, adapter.spec.max_position or 0)
    if tokens <= 0:
        return
    from blend.flex_rows import prepare_flex

    spec = adapter.spec
    with torch.inference_mode():
        done = prepare_flex(tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim, adapter.dtype,
                            adapter.device, scale)
    log.info("compiled FlexAttention for %d shapes up to %d keys in %.1f s", done["shapes"],
             done["max_keys"], done["seconds"])


def build_probe_graphs(blend_config, adapter, scale: float, max_tokens: int):
    """The query probe's CUDA graphs for prompts up to ``max_tokens``, every bucket captured
    now (:meth:`blend.probe_graphs.ProbeGraphs.prepare_all`); None when ``max_tokens`` <= 0,
    ``blend_config.selection`` does not probe or its ``probe_layers`` are not the model's
    (logged: graphs are never a reason for the worker to lose its engine; a capture that fails
    leaves the graphs off, see :class:`blend.probe_graphs.ProbeGraphs`).

    Who calls it: :func:`build_worker_engine` at start-up (``blend.probe_graph_tokens``, at
    most the model's positions), and ``kvblend bench gpu`` before timing (up to its longest
    prompt), so that the benchmark replays the buckets a worker captures."""
    from blend.engine_select import QUERY_SELECTIONS

    if not (max_tokens > 0 and blend_config.selection in QUERY_SELECTIONS):
        return None
    from blend.probe_graphs import ProbeGraphs
    from blend.query_selection import probe_layers_for

    try:
        layers = probe_layers_for(blend_config.probe_layers, adapter.spec.num_layers)
    except ValueError as e:  # the blend raises it per request and recovers by full prefill; the engine stays
        log.warning("the query probe's CUDA graphs are off: %s", e)
        return None
    graphs = ProbeGraphs(adapter, scale, max_tokens)
    seconds = graphs.prepare_all(layers)
    log.info("captured the query probe's CUDA graphs in %.1f s: %s", seconds, graphs.stats())
    return graphs
