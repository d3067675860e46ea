"""Paged gather/scatter on fabricated caches of every supported layout (no engine)."""

from __future__ import annotations

import pytest
import torch

from cluster.vllm import paged

pytestmark = pytest.mark.unit

NUM_BLOCKS, BLOCK_SIZE, H, D = 6, 4, 3, 8


def make_cache(layout: str, dtype=torch.float32) -> torch.Tensor:
    shape = {
        "cpu": (NUM_BLOCKS, H, BLOCK_SIZE, 2 * D),
        "packed": (NUM_BLOCKS, H, BLOCK_SIZE, 2 * D),
        "flash_attn": (2, NUM_BLOCKS, BLOCK_SIZE, H, D),
        "flashinfer": (NUM_BLOCKS, 2, BLOCK_SIZE, H, D),
    }[layout]
    return torch.zeros(shape, dtype=dtype)


def element_address(layout: str, k_or_v: int, slot: int, head: int, dim: int) -> tuple[int, ...]:
    """Where one element lives, written out independently of kv_views (the layout spec)."""
    block, off = divmod(slot, BLOCK_SIZE)
    if layout == "flash_attn":
        return (k_or_v, block, off, head, dim)
    if layout == "flashinfer":
        return (block, k_or_v, off, head, dim)
    if layout == "packed":
        return (block, head, off, k_or_v * D + dim)
    # cpu ('vec' ISA): per (block, head): K^T [D, B] then V [B, D], in a [B, 2D] row view
    flat = k_or_v * BLOCK_SIZE * D + (dim * BLOCK_SIZE + off if k_or_v == 0 else off * D + dim)
    return (block, head, flat // (2 * D), flat % (2 * D))


@pytest.mark.parametrize("layout", paged.LAYOUTS)
def test_scatter_gather_round_trip(layout):
    cache = make_cache(layout)
    slots = torch.tensor([5, 6, 7, 8, 13, 2, 23])  # crosses blocks, not in order
    kv = torch.randn(2, len(slots), H, D)
    paged.scatter_kv(cache, layout, kv, slots)
    assert torch.equal(paged.gather_kv(cache, layout, slots), kv)
    # every written element sits at the layout's documented address; nothing else changed
    expect = torch.zeros_like(cache)
    for t, slot in enumerate(slots.tolist()):
        for s in range(2):
            for h in range(H):
                for d in range(D):
                    expect[element_address(layout, s, slot, h, d)] = kv[s, t, h, d]
    assert torch.equal(cache, expect)


@pytest.mark.parametrize("layout", paged.LAYOUTS)
def test_bf16_bit_exact(layout):
    cache = make_cache(layout, torch.bfloat16)
    slots = torch.arange(0, NUM_BLOCKS * BLOCK_SIZE)
    kv = torch.randn(2, len(slots), H, D).to(torch.bfloat16)
    paged.scatter_kv(cache, layout, kv, slots)
    assert torch.equal(paged.gather_kv(cache, layout, slots), kv)


def test_out_of_range_slots_and_bad_shapes_raise():
    cache = make_cache("flash_attn")
    with pytest.raises(ValueError, match="outside"):
        paged.scatter_kv(cache, "flash_attn", torch.zeros(2, 1, H, D), torch.tensor([NUM_BLOCKS * BLOCK_SIZE]))
    with pytest.raises(ValueError, match="tokens of KV"):
        paged.scatter_kv(cache, "flash_attn", torch.zeros(2, 2, H, D), torch.tensor([0]))
    with pytest.raises(ValueError, match="unknown paged KV layout"):
        paged.kv_views(cache, "nhd")
    with pytest.raises(ValueError, match="needs"):
        paged.kv_views(cache, "flashinfer")


def test_slot_mapping_for():
    slots = paged.slot_mapping_for([7, 2, 9], 4, 2, 10)
    assert slots.tolist() == [30, 31, 8, 9, 10, 11, 36, 37]
    with pytest.raises(ValueError, match="do not cover"):
        paged.slot_mapping_for([7], 4, 0, 5)


def test_detect_layout():
    assert paged.detect_layout(make_cache("cpu"), True) == "cpu"
    assert paged.detect_layout(make_cache("packed"), False) == "packed"
    assert paged.detect_layout(make_cache("flash_attn"), False) == "flash_attn"
    assert paged.detect_layout(make_cache("flashinfer"), False) == "flashinfer"


def test_claimed_layer_writes_put_only_the_claimed_rows_at_their_slots():
    caches = [make_cache("flash_attn") for _ in range(2)]
    slots = torch.tensor([9, 10, 11, 3, 4])  # rows 2..6 of a 7-row prompt
    writes = paged.ClaimedLayerWrites(2, 7, slots, lambda i, kv, s: paged.scatter_kv(caches[i], "flash_attn", kv, s))
    layers = [torch.randn(2, 8, H, D) for _ in range(2)]  # the engine may hand more rows than claimed
    for i, kv in enumerate(layers):
        writes(i, kv)
    for cache, kv in zip(caches, layers, strict=True):
        assert torch.equal(paged.gather_kv(cache, "flash_attn", slots), kv[:, 2:7])
        assert int((cache != 0).sum()) == kv[:, 2:7].numel()  # nothing outside the claimed rows' slots
    assert writes.all_finite()


def test_claimed_layer_writes_keep_a_non_finite_row_until_reset():
    writes = paged.ClaimedLayerWrites(1, 3, torch.tensor([0, 1]), lambda *a: None)
    outside = torch.zeros(2, 4, H, D)
    outside[0, 3] = float("nan")  # past the claimed rows: not the request's
    writes(0, outside)
    assert writes.all_finite()
    bad = torch.zeros(2, 4, H, D)
    bad[1, 2, 0, 0] = float("inf")
    writes(1, bad)
    writes(2, torch.zeros(2, 4, H, D))  # a later finite layer does not clear it
    assert not writes.all_finite()
    writes.reset()  # a full prefill rewrites every layer
    writes(0, torch.zeros(2, 3, H, D))
    assert writes.all_finite()
    with pytest.raises(RuntimeError, match="2 rows, 3 claimed"):
        writes(1, torch.zeros(2, 2, H, D))
