"""RoPE re-rotation and the gate (../shared/cases/per-model-accuracy-gate.md).

Tolerance for re-rotated vs freshly rotated K (float32): HF forms the angle ``p * inv_freq``
in float32, whose rounding error grows with the angle (ulp(500 rad) ~ 3e-5), so K values
O(1) agree to ~1e-4; we allow atol=rtol=5e-4 at positions < 200.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from blend.attention import blocked_row_attention, dense_attention_reference
from blend.rope import apply_rope, check_blendable, inv_freq_for, rerotate_k
from tests.factories import (
    F32_TOL,
    blend_prompt,
    plan_for,
    random_chunks,
    store_chunks,
    tiny_adapter,
)

pytestmark = pytest.mark.unit

ROPE_TOL = dict(rtol=5e-4, atol=5e-4)

LINEAR = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", list(LINEAR))
def test_inv_freq_matches_transformers(name):
    adapter = tiny_adapter(rope_parameters=LINEAR[name])
    ours = inv_freq_for(adapter.spec)
    assert_close(ours, adapter.core.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(LINEAR))
def test_rerotated_k_matches_k_at_new_positions(name):
    """K computed at positions p, re-rotated to p', equals K computed at p' (YaRN's attention
    factor is carried by the stored K and not applied twice)."""
    adapter = tiny_adapter(rope_parameters=LINEAR[name])
    hidden = torch.randn(30, adapter.spec.hidden_size)
    old_pos = torch.arange(30)
    new_pos = torch.arange(100, 130)
    _, k_old, _, _ = adapter.qkv(0, hidden, None, old_pos)
    _, k_new, _, _ = adapter.qkv(0, hidden, None, new_pos)
    moved = adapter.rotate_k(k_old, old_pos, new_pos)
    assert_close(moved, k_new, **ROPE_TOL)
    assert not torch.allclose(k_old, k_new, **ROPE_TOL)  # the move was not a no-op


def test_rerotate_composes_and_reference_rope():
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    x = torch.randn(12, 2, 16)
    p = torch.arange(12)
    assert_close(rerotate_k(apply_rope(x, p, inv), p, p + 37, inv), apply_rope(x, p + 37, inv), **ROPE_TOL)
    assert_close(rerotate_k(x, p, p, inv), x, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="must be"):
        rerotate_k(x, p[:3], p, inv)


@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_scaled_rope_blends_exactly_at_ratio_one(make_setup, name):
    engine, client = make_setup(rope_parameters=LINEAR[name])
    chunks = random_chunks(3, 20)
    store_chunks(engine, client, chunks)
    ids, spans = blend_prompt([1, 2], [chunks[2], chunks[0], chunks[1]], [4, 5])
    res = engine.blend(plan_for(ids, spans, client, ratio=1.0))
    assert res.counters.reused_tokens == 60
    assert_close(res.logits, engine.prefill(ids).logits, **F32_TOL)


@pytest.mark.parametrize("params, word", [
    ({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 64}, "longrope"),
])
def test_nonlinear_rope_is_refused(make_setup, params, word):
    engine, client = make_setup(rope_parameters=params)
    chunks = random_chunks(2, 20)
    store_chunks(engine, client, chunks)  # prefill itself works (HF's own RoPE)
    ids, spans = blend_prompt([1, 2], chunks, [4, 5])
    with pytest.raises(ValueError, match=f"rope_type='{word}'.*refused"):
        engine.blend(plan_for(ids, spans, client))
    with pytest.raises(ValueError, match="refused"):
        check_blendable(engine.spec, 10)


def test_sliding_window_shorter_than_prompt_is_refused(make_setup):
    engine, client = make_setup("mistral", sliding_window=32)
    chunks = random_chunks(3, 20)
    store_chunks(engine, client, chunks)
    ids, spans = blend_prompt([1, 2], chunks, [4, 5])
    with pytest.raises(ValueError, match="sliding_window=32 shorter than the prompt"):
        engine.blend(plan_for(ids, spans, client))
    # A window longer than the prompt is fine.
    engine2, client2 = make_setup("mistral", sliding_window=4096)
    store_chunks(engine2, client2, chunks)
    assert engine2.blend(plan_for(ids, spans, client2)).counters.reused_tokens == 60


@pytest.mark.parametrize("gqa", [1, 3])
def test_scattered_rows_attention_matches_dense_reference(gqa):
    torch.manual_seed(0)
    num_tokens, kv_heads, dim = 50, 2, 8
    q = torch.randn(num_tokens, kv_heads * gqa, dim)
    k = torch.randn(num_tokens, kv_heads, dim)
    v = torch.randn(num_tokens, kv_heads, dim)
    rows = torch.tensor([0, 3, 4, 17, 30, 49])
    got = blocked_row_attention(q[rows], k, v, rows, dim ** -0.5)
    want = dense_attention_reference(q[rows], k, v, rows, dim ** -0.5)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_close(blocked_row_attention(q, k, v, None, 0.3), dense_attention_reference(q, k, v, None, 0.3), rtol=1e-5, atol=1e-5)
    # A row's output depends only on keys at or before it.
    k2 = k.clone()
    k2[18:] = 100.0
    assert_close(blocked_row_attention(q[rows[:4]], k2, v, rows[:4], 0.3), blocked_row_attention(q[rows[:4]], k, v, rows[:4], 0.3))


def test_attention_blocks_and_unsorted_rows_match_reference():
    """More rows than one query block, given out of order (the blocked path sorts them)."""
    from blend.attention import QUERY_BLOCK

    torch.manual_seed(1)
    num_tokens = 2 * QUERY_BLOCK + 90
    q = torch.randn(num_tokens, 4, 8)
    k = torch.randn(num_tokens, 2, 8)
    v = torch.randn(num_tokens, 2, 8)
    rows = torch.randperm(num_tokens)[:QUERY_BLOCK * 2 + 10]
    assert_close(blocked_row_attention(q[rows], k, v, rows, 0.35), dense_attention_reference(q[rows], k, v, rows, 0.35),
                 rtol=1e-5, atol=1e-5)


def test_in_place_rotation_of_concatenated_chunks_equals_rotating_each_chunk():
    """The engine re-rotates the K of all hit chunks of a layer, concatenated, in place
    (:func:`blend.ops.rerotate_k_`): each chunk must get exactly the bits of
    :func:`blend.rope.rerotate_k` on that chunk alone (what the bit-exactness tests compare)."""
    from blend import ops

    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)).float()  # [32]
    g = torch.Generator().manual_seed(5)
    chunks = ((3, 103), (105, 205), (207, 298))  # prompt rows of three hit chunks
    to = torch.cat([torch.arange(s, e) for s, e in chunks])
    frm = torch.cat([torch.arange(e - s) for s, e in chunks])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k = torch.randn(to.numel(), 2, 64, generator=g).to(dtype)
        got = k.clone()
        assert ops.rerotate_k_(got, frm, to, inv) is got
        offset = 0
        for s, e in chunks:
            part = slice(offset, offset + e - s)
            assert torch.equal(got[part], rerotate_k(k[part], frm[part], to[part], inv))
            offset += e - s
