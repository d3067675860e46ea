"""Preemption while stores are in flight never stores foreign bytes under a valid key (issue
#20; vLLM #52360: an offloading connector's async save read blocks that vLLM had already
handed to another request).

The in-process engine (``blend_llm``) gets five new prompts at once — four blend-path prompts
over four passages nobody stored, one prefix-path prompt — with its block pool cut to what two
of them need (:func:`tests.cluster.vllm.pressure.run_with_few_blocks`), so vLLM preempts
running requests and hands their blocks to others. Every put of the worker's store I/O
thread is held until the engine is done: gathered prefix chunks and computed canonical
segments wait, holding their KV, while the preemptions happen. Then each chunk put is checked
against its own KV, computed afterwards from the token ids its key was made from (the
oracle: the worker's canonical prefill of those tokens alone), and read back from the cache
bit for bit as it was put.
"""

from __future__ import annotations

import threading

import pytest
import torch

from blend.segments import build_blend_prompt
from tests.cluster.vllm.helpers import FULL, SYSTEM, assert_matches_full, passage
from tests.cluster.vllm.pressure import run_with_few_blocks, short_of_a_block

pytestmark = pytest.mark.engine

#: seconds a held put waits for the engine to finish (a hang guard)
HOLD_S = 600.0


def test_preemption_with_stores_in_flight_stores_each_keys_own_kv(blend_llm, tokenizer, monkeypatch):
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = blend_llm.llm_engine.engine_core.engine_core
    scheduler, connector = core.scheduler, core.scheduler.connector.connector_scheduler
    worker = get_kv_transfer_group().connector_worker
    block_size, max_tokens = scheduler.block_size, 12
    texts = [passage(2600 + i, num_sentences=6) for i in range(4)]
    prompts = {f"ps-{i}": short_of_a_block(block_size, lambda pad, order=order: build_blend_prompt(
                   tokenizer, SYSTEM, [texts[j] for j in order], f"Question{pad}: which item is {26001 + order[0]}?")[0])
               for i, order in enumerate([(0, 1, 2), (3, 0, 1), (2, 3, 0), (1, 2, 3)])}
    plain = passage(2650, num_sentences=10)
    prompts["ps-prefix"] = short_of_a_block(block_size, lambda pad: tokenizer.encode(f"{SYSTEM} {plain}{pad}"))

    def params(rid, full=False):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True)
        if full:
            sp.extra_args = {"kv_transfer_params": {**FULL, "kvblend_store": False}}  # stores nothing
        return sp

    refs = {rid: blend_llm.generate([{"prompt_token_ids": ids}], params(rid, full=True), use_tqdm=False)[0]
            for rid, ids in prompts.items()}

    # what each key stands for, as the scheduler planned it: (token ids, start, end) -> KV of
    # tokens [start, end) computed with ids[:end] before them
    planned: dict = {}
    real_spec = connector._store_spec

    def spec_spy(rid, state, block_ids, computed_after):
        for key, ids in state.store_segments:
            planned[key] = (list(ids), 0, len(ids))
        for key, start, end in state.store_prefix:
            if end <= computed_after:
                planned[key] = (list(state.token_ids[:end]), start, end)
        return real_spec(rid, state, block_ids, computed_after)

    # every put waits until the engine is done: the stores are in flight during the preemptions
    release, puts = threading.Event(), []
    client = worker.stores.client
    real_put = client.put

    def held_put(key, kv, *a, **kw):
        assert release.wait(HOLD_S), "the engine never finished"
        puts.append((key, kv.detach().clone()))
        return real_put(key, kv, *a, **kw)

    in_flight_at_preemption: list[int] = []
    monkeypatch.setattr(connector, "_store_spec", spec_spy)
    monkeypatch.setattr(client, "put", held_put)
    finals = run_with_few_blocks(blend_llm, prompts, params,
                                 lambda request: in_flight_at_preemption.append(worker.stores._io_items),
                                 before_settle=release.set)
    monkeypatch.undo()
    print(f"chunks in flight at each preemption: {in_flight_at_preemption}; {len(puts)} puts")
    assert in_flight_at_preemption, "no request was preempted"
    assert max(in_flight_at_preemption) > 0, "no preemption while stores were in flight"
    assert set(finals) == set(prompts)
    for rid, out in finals.items():
        assert_matches_full(out, refs[rid])

    assert len(puts) >= 5  # the passages, the system prompt, the plain prompt's prefix chunks
    assert len({k for k, _ in puts}) == len(puts)
    for key, kv in puts:
        assert key in planned, f"{key} was put but never planned"
        ids, start, end = planned[key]
        own = worker._canonical_kv(ids)[:, :, start:end]  # [L, 2, T, H, D]
        assert kv.shape == own.shape, key
        # another request's KV differs by O(1); vLLM's batched forward vs our prefill by rounding
        torch.testing.assert_close(kv, own.to(kv.dtype), atol=2e-3, rtol=2e-3, msg=lambda m, k=key: f"{k}: {m}")
        stored = torch.stack([client.fetch_layer([key], i).result(60)[0] for i in range(kv.shape[0])])
        assert torch.equal(stored, kv), f"{key}: the cache holds other bytes than were put"
