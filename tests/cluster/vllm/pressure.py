"""Memory pressure for the in-process engine's tests (``blend_llm``): a block pool cut so that
vLLM must preempt running requests (``handle_preemptions``, issue #20's vLLM #52360 case).

:func:`short_of_a_block` pads a prompt so that its 5th decoded token needs a new block;
:func:`run_with_few_blocks` takes every free block but what the two largest prompts need,
adds the prompts at once, steps the engine to the end, and gives the blocks back.
"""

from __future__ import annotations

from collections.abc import Callable


def short_of_a_block(block_size: int, make: Callable[[str], list[int]]) -> list[int]:
    """``make(padding)`` padded so that the prompt's last block has 4 free slots: its 5th
    decoded token needs a new block (``padding`` is ``" well" * n``)."""
    for n in range(2 * block_size):
        ids = make(" well" * n)
        if len(ids) % block_size == block_size - 4:
            return ids
    raise AssertionError("no padding ends the prompt 4 tokens short of a block")


def run_with_few_blocks(llm, prompts: dict[str, list[int]], params: Callable[[str], object],
                        on_preempt: Callable[[object], None],
                        before_settle: Callable[[], None] | None = None) -> dict[str, object]:
    """Add ``prompts`` (request id -> token ids, each with ``params(request_id)``) at once to
    ``llm``'s engine, whose block pool keeps only what the two largest prompts need: the
    first of them to decode past its last block finds no free block and vLLM preempts a
    running request. ``on_preempt(request)`` runs before each preemption. Steps the engine
    until every request finished (a guard of 20,000 steps), calls ``before_settle()`` (also
    after an error), settles the connector's stores, and always returns the blocks. Returns
    request id -> final output."""
    from cluster.vllm.offline import settle

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    block_size = scheduler.block_size
    pool = scheduler.kv_cache_manager.block_pool
    keep = sum(sorted((len(ids) // block_size + 1 for ids in prompts.values()), reverse=True)[:2])
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - keep)
    real_preempt = scheduler._preempt_request

    def spy(request, *a, **kw):
        on_preempt(request)
        return real_preempt(request, *a, **kw)

    scheduler._preempt_request = spy
    engine = llm.llm_engine
    finals = {}
    try:
        try:
            for rid, ids in prompts.items():
                engine.add_request(rid, {"prompt_token_ids": ids}, params(rid))
            for _ in range(20_000):
                if not engine.has_unfinished_requests():
                    break
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        finally:
            if before_settle is not None:
                before_settle()
        settle(llm)
    finally:
        del scheduler._preempt_request  # the class's method again
        pool.free_blocks(taken)
    return finals
