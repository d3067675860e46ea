"""Driving an in-process ``vllm.LLM`` with the connector (tests, benchmarks, examples).

vLLM's engine-core process keeps stepping by itself after a request finishes, which is when the
connector computes its queued stores (:mod:`cluster.vllm.store_queue`). An in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, "offline" inference) only steps inside
``LLM.generate``; :func:`settle` runs the remaining steps so that a following lookup sees the
chunks the previous requests stored.
"""

from __future__ import annotations


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

    from cluster.vllm.connector import KVBlendConnector

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
