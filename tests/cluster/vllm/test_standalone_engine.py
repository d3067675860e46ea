"""Issue 21 inside vLLM (in-process engine, SmolLM2 float32, ratio 1.0): a passage sent alone is
stored under its chunk key as exactly its canonical KV (gathered from vLLM's paged cache: the
tokenizer adds no BOS, so nothing sat before it), it is reused in first position of a prompt with
no system prompt, and that prompt's other passage is reused first in the next one; outputs
equal vLLM's full prefill."""

from __future__ import annotations

import pytest
from torch.testing import assert_close

from blend.segments import build_blend_prompt, chunk_token_ids
from tests.cluster.vllm.helpers import (
    FULL,
    assert_matches_full,
    events,
    generate,
    passage,
    request_id_of,
    wait_stored,
)
from tiers.keys import segment_key

pytestmark = pytest.mark.engine


def test_passage_alone_is_its_canonical_chunk_and_first_passages_are_reused(blend_llm, blend_stats_path, tokenizer):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    a, b = passage(2101, num_sentences=5), passage(2102, num_sentences=5)
    ids_a = chunk_token_ids(tokenizer, a)
    alone = generate(blend_llm, ids_a)                      # (a) no separator
    wait_stored(blend_stats_path, request_id_of(alone))
    key = segment_key(conn.namespace_digest, ids_a)
    (meta,) = conn.client.lookup([key])
    assert meta is not None and tuple(meta.positions) == tuple(range(len(ids_a)))
    canonical = conn.connector_worker._canonical_kv(ids_a)  # [L, 2, T, H, D]: the worker's own prefill
    for layer in range(canonical.shape[0]):
        (stored,) = conn.client.fetch_layer([key], layer).result(timeout=30)
        assert_close(stored.cpu(), canonical[layer], rtol=1e-4, atol=2e-4)  # measured <= 4.3e-5

    q = "Question: Which item number is in the first passage? Answer:"
    first, _ = build_blend_prompt(tokenizer, a, [b], q, add_bos=False)   # (c) no system prompt
    out = generate(blend_llm, first)
    lookup = events(blend_stats_path, request_id_of(out), "lookup")[0]
    assert (lookup["path"], lookup["num_segments"], lookup["num_hit_segments"]) == ("blend", 2, 1)
    assert_matches_full(out, generate(blend_llm, first, FULL))
    wait_stored(blend_stats_path, request_id_of(out))      # b, computed canonically

    swapped, _ = build_blend_prompt(tokenizer, b, [a], q, add_bos=False)
    out = generate(blend_llm, swapped)
    load = events(blend_stats_path, request_id_of(out), "load")[0]
    assert (load["path"], load["num_segments"], load["num_hit_segments"]) == ("blend", 2, 2) and not load["fallback"]
    assert_matches_full(out, generate(blend_llm, swapped, FULL))
