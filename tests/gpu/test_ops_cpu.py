"""CPU: blend.ops reference paths, the FlexAttention block mask, the staging source, the bench CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from blend import engine as engine_module
from blend import ops
from blend.attention import attend, attend_reference
from blend.engine import BlendEngine
from blend.rope import rerotate_k
from blend.selection import k_deviation, num_to_select, select_top
from tests.gpu.factories import (
    F32_TOL,
    NAMESPACE,
    chunk_ids,
    encode,
    fill_tiers,
    make_plan,
    tiny_adapter,
)
from tiers.disk import DiskTier
from tiers.gpu import GpuTier
from tiers.host import HostTier
from tiers.keys import segment_key
from tiers.staging import StagedSource
from tiers.tier import MemoryTier


def test_select_top_with_candidates_threshold_and_ratio():
    scores = torch.tensor([0.5, 3.0, 0.1, 2.0, 9.0, 0.0])
    rows = torch.tensor([10, 11, 12, 13, 14, 15])
    assert ops.select_top(scores, 0.5, None, rows).tolist() == [11, 13, 14]
    assert ops.select_top(scores, 0.5, 2.5, rows).tolist() == [11, 14]
    assert ops.select_top(scores, 0.5).tolist() == select_top(scores, num_to_select(6, 0.5)).tolist()
    assert ops.select_top(scores, 0.15, None, rows, num_reused=20).tolist() == [11, 13, 14]
    assert ops.select_top(scores, 0.0, None, rows).numel() == 0
    with pytest.raises(ValueError):
        ops.select_top(scores, 1.5)
    with pytest.raises(ValueError):
        ops.select_top(scores, 0.5, None, rows[:3])


def test_cpu_dispatch_equals_references():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(20, 2, 16, generator=g)
    frm, to = torch.arange(20), torch.arange(20) + 40
    inv = (1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)).float()
    want = rerotate_k(k, frm, to, inv)
    assert torch.equal(ops.rerotate_k_(k, frm, to, inv), want) and torch.equal(k, want)
    fresh, cached = torch.randn(7, 2, 16, generator=g), torch.randn(20, 2, 16, generator=g)
    idx = torch.tensor([3, 1, 19, 0, 5, 6, 2])
    assert torch.equal(ops.k_deviation_scores(fresh, cached, None, idx), k_deviation(fresh, cached[idx]))


@pytest.mark.parametrize("layout,shape", [("flash_attn", (2, 5, 4, 2, 8)), ("flashinfer", (5, 2, 4, 2, 8))])
def test_paged_ops_match_cluster_paged(layout, shape):
    from cluster.vllm.paged import gather_kv, scatter_kv

    g = torch.Generator().manual_seed(2)
    cache = torch.randn(shape, generator=g)
    slots = torch.tensor([19, 0, 7, 8, 3])
    assert torch.equal(ops.gather_paged(cache, layout, slots), gather_kv(cache, layout, slots))
    kv = torch.randn(2, 5, 2, 8, generator=g)
    a, b = cache.clone(), cache.clone()
    ops.scatter_paged(a, layout, kv, slots)
    scatter_kv(b, layout, kv, slots)
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        ops.gather_paged(cache, layout, torch.tensor([20]))


@pytest.mark.parametrize("num_keys,num_q,block", [(300, 40, 16), (130, 130, 128), (257, 9, 32)])
@pytest.mark.parametrize("ordered", [True, False])
def test_block_mask_gives_per_row_causal_attention(num_keys, num_q, block, ordered):
    """Eager FlexAttention with :func:`ops.build_block_mask` equals the dense float64 reference."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(num_keys + num_q)
    q = torch.randn(num_q, 4, 16, generator=g)
    k, v = torch.randn(num_keys, 2, 16, generator=g), torch.randn(num_keys, 2, 16, generator=g)
    pos = torch.randperm(num_keys, generator=g)[:num_q]
    if ordered:
        pos = pos.sort().values
    mask = ops.build_block_mask(pos, torch.arange(num_keys) if ordered else None, num_keys, block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             block_mask=mask, scale=0.25, enable_gqa=True)
    got = out[0].transpose(0, 1).reshape(num_q, -1)
    torch.testing.assert_close(got, attend_reference(q, k, v, pos, 0.25), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.selected_row_attention(q, pos, k, v, None, 0.25),
                               attend_reference(q, k, v, pos, 0.25), rtol=1e-5, atol=1e-5)


def test_attend_is_a_drop_in_for_the_engine_attend(monkeypatch):
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(50, 4, 16, generator=g), torch.randn(50, 2, 16, generator=g), torch.randn(50, 2, 16, generator=g)
    torch.testing.assert_close(ops.attend(q, k, v, None, 0.25), attend(q, k, v, None, 0.25))
    idx = torch.tensor([0, 7, 8, 30, 49])
    monkeypatch.setattr(ops, "REFERENCE_QUERY_BLOCK", 2)  # several query blocks
    torch.testing.assert_close(ops.attend(q[idx], k, v, idx, 0.25), attend(q[idx], k, v, idx, 0.25))
    with pytest.raises(ValueError):
        ops.attend(q[:3], k, v, idx, 0.25)


def _objects(num_chunks=3, num_layers=3, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(9)
    out = {}
    for i in range(num_chunks):
        key = segment_key(NAMESPACE, [i, 100 + i])
        out[key] = torch.randn(num_layers, 2, 5 + i, 2, 8, generator=g).to(dtype)
    return out


def test_staged_source_round_trips_every_tier_bit_exact(tmp_path):
    chunks = _objects()
    host, disk, gpu, mem = HostTier(1 << 26), DiskTier(str(tmp_path), 1 << 26, fsync=False), GpuTier(1 << 26), MemoryTier(1 << 26)
    for key, kv in chunks.items():
        obj = encode(key, kv)
        host.put(key, obj), disk.put(key, obj), mem.put(key, obj), gpu.put(key, kv)
    keys = list(chunks)
    for tier in (host, disk, mem, gpu):
        src = StagedSource(tier, "cpu", read_ahead=1)
        metas = src.lookup(keys)
        assert [m.num_tokens for m in metas] == [5, 6, 7] and metas[0].positions == tuple(range(5))
        assert metas[0].tier == tier.name
        for layer in range(3):
            got = src.fetch_layer(keys, layer).result()
            assert all(torch.equal(x, chunks[key][layer]) for x, key in zip(got, keys, strict=False)), tier.name
        src.close()


def test_staged_source_corrupt_or_missing_is_none(tmp_path):
    chunks = _objects()
    host = HostTier(1 << 26)
    keys = list(chunks)
    for i, (key, kv) in enumerate(chunks.items()):
        obj = bytearray(encode(key, kv))
        if i == 1:
            obj[-3] ^= 0xFF  # flip a byte in the last layer's payload
        host.put(key, bytes(obj))
    missing = segment_key(NAMESPACE, [999])
    src = StagedSource(host, "cpu")
    assert src.lookup(keys + [missing])[-1] is None
    got = src.fetch_layer(keys + [missing], 2).result()
    assert got[1] is None and got[3] is None
    assert torch.equal(got[0], chunks[keys[0]][2]) and torch.equal(got[2], chunks[keys[2]][2])
    assert src.fetch_layer(keys, 0).result()[1] is not None  # only the flipped layer is bad
    assert src.fetch_layer(keys, 7).result() == [None, None, None]  # past the layers
    assert src.read_counters.snapshot()["corrupt"] >= 1
    src.close()


def test_staged_source_drops_a_header_that_went_stale(tmp_path):
    """The object under a key is re-encoded (raw -> lz4: other offsets and checksums) after
    its header was cached: that read is a miss, the header is dropped, and the next reads are
    bit-exact again (the stale header does not stick)."""
    g = torch.Generator().manual_seed(3)
    key = segment_key(NAMESPACE, [7, 8])
    kv = torch.randint(-2, 3, (3, 2, 64, 2, 8), generator=g).to(torch.bfloat16)  # lz4 shrinks it
    disk = DiskTier(str(tmp_path), 1 << 26, fsync=False)
    disk.put(key, encode(key, kv))
    src = StagedSource(disk, "cpu", read_ahead=0)
    assert src.lookup([key])[0] is not None
    assert torch.equal(src.fetch_layer([key], 0).result()[0], kv[0])
    disk.delete([key])
    disk.put(key, encode(key, kv, compress=True))
    assert src.fetch_layer([key], 1).result()[0] is None   # read with the cached raw header
    for layer in (2, 0, 1):
        assert torch.equal(src.fetch_layer([key], layer).result()[0], kv[layer]), layer
    src.close()


@pytest.mark.parametrize("ratio", [1.0, 0.3])
def test_engine_with_ops_over_staged_host_tier(monkeypatch, ratio):
    """The proposed integration on CPU: ops.attend in the engine, ops re-rotation, KV staged
    from a host tier. Ratio 1.0 reproduces full prefill; 0.3 matches the engine as it is."""
    adapter = tiny_adapter()
    chunks = chunk_ids(3, 24)
    host = HostTier(1 << 26)
    fill_tiers(BlendEngine(adapter), chunks, [host])
    plan = make_plan(chunks, ratio)
    src = StagedSource(host, "cpu")
    src.lookup([s.key for s in plan.hit_segments])
    as_is = BlendEngine(adapter, src).blend(plan)
    monkeypatch.setattr(engine_module, "attend", ops.attend)
    got = BlendEngine(adapter, src).blend(plan)
    assert got.counters.full_prefill_reason is None and got.counters.num_hit_segments == 3
    torch.testing.assert_close(got.logits, as_is.logits, **F32_TOL)
    if ratio == 1.0:
        full = BlendEngine(adapter).prefill(list(plan.token_ids))
        torch.testing.assert_close(got.logits, full.logits, **F32_TOL)
        for a, b in zip(got.kv, full.kv, strict=False):
            torch.testing.assert_close(a, b, **F32_TOL)
    src.close()


BLOCKER = ("import sys\n"
           "for m in ('ray', 'redis', 'boto3', 'lz4', 'vllm'):\n"
           "    sys.modules[m] = None\n"
           "from cluster.cli.main import main\n"
           "sys.exit(main(['bench', 'gpu', '--help']))\n")


def test_bench_gpu_help_without_heavy_modules():
    proc = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--json" in proc.stdout and "--page-cache" in proc.stdout


def test_bench_gpu_tiny_runs_end_to_end(tmp_path):
    from cluster.cli.main import main

    path = tmp_path / "gpu.json"
    rc = main(["bench", "gpu", "--json", str(path), "--tiny", "--device", "cpu", "--lengths", "300",
               "--chunk-tokens", "64", "--repeats", "1", "--disk-dir", str(tmp_path / "disk")])
    assert rc == 0
    row = json.loads(path.read_text())["results"]["300"]
    for key in ("full_s", "blend_gpu_s", "blend_host_s", "blend_disk_s", "ratio_host", "h2d_gbps",
                "h2d_baseline_gbps", "overlap"):
        assert isinstance(row[key], float) and row[key] >= 0, key
    assert row["ratio_host"] == pytest.approx(row["blend_host_s"] / row["full_s"])
    assert row["overlap"] == pytest.approx(row["blend_host_s"] / row["blend_gpu_s"])
    assert row["selected_tokens"] == num_to_select(row["reused_tokens"], 0.15)
    assert row["disk_read_counters"]["hits"] > 0 and row["disk_read_counters"]["corrupt"] == 0


@pytest.mark.parametrize("num_q", [1, 77, 128, 300])
def test_flex_path_pads_queries_and_matches_reference(monkeypatch, num_q):
    """The CUDA path (query padding to 128 rows, cached key blocks), run with eager flex."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(ops, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(num_q)
    q = torch.randn(num_q, 4, 16, generator=g)
    k, v = torch.randn(400, 2, 16, generator=g), torch.randn(400, 2, 16, generator=g)
    pos = torch.randperm(400, generator=g)[:num_q].sort().values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ops._flex_rows(q, pos, k, v, None, 0.25)
        got_kv = ops._flex_rows(q, pos, k, v, torch.arange(400), 0.25)
    want = attend_reference(q, k, v, pos, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv, want, rtol=1e-5, atol=1e-5)


def test_angle_table_cache_misses_on_in_place_edit():
    from blend.kernels.rope import angle_table

    frm, to = torch.arange(6), torch.arange(6) + 3
    inv = torch.tensor([1.0, 0.5])
    cos1, _ = angle_table(frm, to, inv, torch.device("cpu"))
    assert angle_table(frm, to, inv, torch.device("cpu"))[0] is cos1  # reused
    to += 1  # same tensor, new contents
    cos2, _ = angle_table(frm, to, inv, torch.device("cpu"))
    assert cos2 is not cos1 and torch.allclose(cos2[:, 0], torch.cos(torch.full((6,), 4.0, dtype=torch.float64)).float())


def test_prepared_rows_are_reused_and_checked(monkeypatch):
    """A RowMask built once per request gives the same attention as per-call masks."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(ops, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(21)
    pos = torch.randperm(500, generator=g)[:150].sort().values
    rows = ops.prepare_rows(pos, 500)
    assert rows.num_q == 150 and rows.q_pos_padded.numel() == 256
    want_all = []
    for _layer in range(2):  # two layers, same rows, new q/k/v
        q = torch.randn(150, 4, 16, generator=g)
        k, v = torch.randn(500, 2, 16, generator=g), torch.randn(500, 2, 16, generator=g)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = ops._flex_rows(q, pos, k, v, None, 0.25, rows)
        want = attend_reference(q, k, v, pos, 0.25)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ops.attend(q, k, v, pos, 0.25, rows), want, rtol=1e-5, atol=1e-5)
        want_all.append(want)
    with pytest.raises(ValueError, match="prepared"):
        ops.selected_row_attention(q[:10], pos[:10], k, v, None, 0.25, rows=rows)
    with pytest.raises(TypeError):
        ops.prepare_rows(pos.float(), 500)


def test_staged_source_decodes_lz4_layers(tmp_path):
    from tiers.format import encode_chunk

    key = segment_key(NAMESPACE, [7, 7, 7])
    kv = torch.ones(2, 2, 64, 2, 8, dtype=torch.bfloat16)  # compressible: stored as lz4
    kv[1] *= 3
    raw = kv.view(torch.uint8).view(2, -1).numpy()
    obj = encode_chunk(key, [raw[0], raw[1]], dtype="bfloat16", num_tokens=64, num_kv_heads=2,
                       head_dim=8, compress=True)
    assert len(obj) < kv.numel() * 2
    for tier in (HostTier(1 << 24), DiskTier(str(tmp_path), 1 << 24, fsync=False)):
        tier.put(key, obj)
        src = StagedSource(tier, "cpu")
        assert src.lookup([key])[0].num_tokens == 64
        for layer in range(2):
            assert torch.equal(src.fetch_layer([key], layer).result()[0], kv[layer])
        assert src.read_counters.snapshot() == {"hits": 2, "misses": 0, "corrupt": 0}
        src.close()
