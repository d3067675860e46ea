"""FlexAttention's compiled shapes (:mod:`blend.flex_shapes`): once a device is prepared, a call
whose (rows, keys) pair was never compiled pads its rows up to a compiled shape for its keys
instead of compiling, and gives the same attention (eager flex on CPU stands in for the
compiled kernel; ``tests/blend/test_ops_cuda.py`` runs the compiled one)."""

from __future__ import annotations

import warnings

import pytest
import torch

from blend import flex_rows, flex_shapes, ops
from blend.attention import dense_attention_reference

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_shapes():
    flex_shapes.reset()
    yield
    flex_shapes.reset()


def test_an_unprepared_device_pads_rows_to_their_own_bucket():
    flex_shapes.note_compiled(CPU, 1536, 1536)
    assert flex_shapes.rows_for(150, 1536, CPU, 256) == 256  # compiles (256, 1536) on first use


def test_a_prepared_device_pads_to_the_fewest_compiled_rows_that_hold_the_call():
    for rows in (1536, 768):
        flex_shapes.note_compiled(CPU, rows, 1536)
    flex_shapes.note_compiled(CPU, 512, 512)
    flex_shapes.note_compiled("cuda:1", 256, 1536)  # another device's shapes do not count
    flex_shapes.mark_prepared(CPU, 1536)
    assert flex_shapes.rows_for(150, 1536, CPU, 256) == 768
    assert flex_shapes.rows_for(1000, 1536, CPU, 1024) == 1536
    flex_shapes.note_compiled(CPU, 256, 1536)
    assert flex_shapes.rows_for(150, 1536, CPU, 256) == 256  # its own pair is compiled now
    assert flex_shapes.rows_for(150, 3072, CPU, 256) == 256  # keys past the prepared ones: own bucket
    assert flex_shapes.compiled_shapes(CPU) == [(256, 1536), (512, 512), (768, 1536), (1536, 1536)]


def test_rows_padded_to_a_larger_compiled_shape_attend_as_before(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_rows, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(150, 4, 16, generator=g)
    k, v = torch.randn(400, 2, 16, generator=g), torch.randn(400, 2, 16, generator=g)
    pos = torch.randperm(400, generator=g)[:150].sort().values
    want = dense_attention_reference(q, k, v, pos, 0.25)
    flex_shapes.note_compiled(CPU, 512, 512)
    flex_shapes.mark_prepared(CPU, 512)
    rows = ops.prepare_rows(pos, 400)
    assert rows.q_pos_padded.numel() == 512  # not its own 256
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flex_rows._flex_rows(q, pos, k, v, None, 0.25, rows)
        got_unprepared = flex_rows._flex_rows(q, pos, k, v, None, 0.25)  # pads to 512 as well (rows=None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_unprepared, want, rtol=1e-5, atol=1e-5)
    assert flex_shapes.compiled_shapes(CPU) == [(512, 512)]  # no (256, 512) was run
    # the padded tiles past the rows' last one read no key block (they did one each at position 0)
    mask = rows.block_mask
    assert mask.kv_num_blocks[0, 0, 2:].tolist() == [0, 0] and mask.full_kv_num_blocks[0, 0, 2:].tolist() == [0, 0]
    assert int(mask.kv_num_blocks[0, 0, :2].sum() + mask.full_kv_num_blocks[0, 0, :2].sum()) > 0


def test_only_flex_pad_tiles_see_no_key():
    pos = torch.tensor([5, 9, 300])
    assert ops.pad_rows(pos, 256).tolist() == [5, 9] + [300] * 126 + [0] * 128  # the probe's padding
    flex = ops.pad_rows(pos, 256, ops.PAD_TILE_POSITION)
    assert flex.tolist() == [5, 9] + [300] * 126 + [ops.PAD_TILE_POSITION] * 128


def test_prepare_flex_is_a_no_op_off_cuda():
    assert ops.prepare_flex(4096, 4, 2, 16, torch.float32, CPU, 0.25) == {"seconds": 0.0, "shapes": 0, "max_keys": 0}
    assert flex_shapes.rows_for(150, 512, CPU, 256) == 256


def test_whole_pad_tiles_change_no_row(monkeypatch):
    """Their queries are left unwritten (flex_rows._padded_rows): NaN there changes no real row
    (the kernel loads them but multiplies them with no key)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_rows, "_compiled_flex", lambda: flex_attention)
    padded_rows = flex_rows._padded_rows

    def nan_tiles(q, length):
        out = padded_rows(q, length)
        tile = -(-q.shape[0] // ops.FLEX_BLOCK) * ops.FLEX_BLOCK
        assert torch.equal(out[q.shape[0]:tile], q[-1:].expand(tile - q.shape[0], -1, -1))
        out[tile:] = float("nan")
        return out

    monkeypatch.setattr(flex_rows, "_padded_rows", nan_tiles)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(150, 4, 16, generator=g)
    k, v = torch.randn(400, 2, 16, generator=g), torch.randn(400, 2, 16, generator=g)
    pos = torch.randperm(400, generator=g)[:150].sort().values
    flex_shapes.note_compiled(CPU, 512, 512)
    flex_shapes.mark_prepared(CPU, 512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flex_rows._flex_rows(q, pos, k, v, None, 0.25, ops.prepare_rows(pos, 400))
    torch.testing.assert_close(got, dense_attention_reference(q, k, v, pos, 0.25), rtol=1e-5, atol=1e-5)


def test_a_failed_flex_call_with_key_positions_falls_back_to_the_unpadded_keys(monkeypatch):
    """The SDPA reference gets the keys as they came (not padded to their bucket) with their
    positions, and the call still answers right."""
    def broken():
        def flex(*args, **kwargs):
            raise RuntimeError("no compiler")
        return flex

    monkeypatch.setattr(flex_rows, "_compiled_flex", broken)
    monkeypatch.setattr(flex_rows, "_FLEX_BROKEN", [])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(150, 4, 16, generator=g)
    k, v = torch.randn(400, 2, 16, generator=g), torch.randn(400, 2, 16, generator=g)
    pos = torch.randperm(400, generator=g)[:150].sort().values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flex_rows._flex_rows(q, pos, k, v, torch.arange(400), 0.25)
    torch.testing.assert_close(got, dense_attention_reference(q, k, v, pos, 0.25), rtol=1e-5, atol=1e-5)
    assert flex_rows._FLEX_BROKEN == ["RuntimeError: no compiler"]
