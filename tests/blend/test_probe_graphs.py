"""The query probe's per-layer graphs (:mod:`blend.probe_graphs`, issue 33) against the eager
probe, on tiny float32 models on the CPU: the same static buffers and step functions a CUDA
graph records run there without capture, so padding, the trash row, the query rows' weights
and the write-back are checked here; the capture itself is checked by the ``gpu`` tests."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from blend import query_selection as qs
from blend.engine import BlendEngine
from blend.probe_graphs import ProbeGraphs
from blend.query_selection import probe_layers_for
from blend.steps import run_steps
from tests.factories import F32_TOL, blend_prompt, plan_for, random_chunks, store_chunks, tiny_model

pytestmark = pytest.mark.unit


def _engines(make_setup, adapter=None):
    eager, client = make_setup("llama")
    if adapter is not None:
        eager = BlendEngine(adapter, client)
    graphs = ProbeGraphs(eager.model, eager.scale, max_tokens=512, capture=False)
    return eager, BlendEngine(eager.model, client, probe_graphs=graphs), graphs, client


def _prompt(client, engine, chunks, *, miss=None, ratio=0.15, selection="query_attention", query=None, **knobs):
    store_chunks(engine, client, [c for i, c in enumerate(chunks) if i != miss])
    ids, spans = blend_prompt([1, 2, 3], chunks, query or [4, 5, 6, 9, 11])
    return plan_for(ids, spans, client, ratio=ratio, selection=selection, **knobs)


def _same(got, want) -> None:
    assert got.counters.full_prefill_reason is None and want.counters.full_prefill_reason is None
    assert got.recompute_idx.tolist() == want.recompute_idx.tolist()  # the same rows were recomputed
    assert_close(got.logits, want.logits, **F32_TOL)
    for a, b in zip(got.kv, want.kv, strict=True):
        assert_close(a, b, **F32_TOL)


def _prepare(graphs, plan):
    assert graphs.prepare_plan(plan)


@pytest.mark.parametrize("selection, knobs", [("query_attention", {}), ("query_k_deviation", {}),
                                               ("query_attention", {"query_funnel": 2.0}),
                                               ("query_k_deviation", {"rank_fusion": 60})])
def test_a_prepared_bucket_gives_the_eager_probe_s_blend(make_setup, selection, knobs):
    eager, fast, graphs, client = _engines(make_setup)
    plan = _prompt(client, eager, random_chunks(3, 24), selection=selection, **knobs)
    _prepare(graphs, plan)
    want, got = eager.blend(plan), fast.blend(plan)
    layers = probe_layers_for(plan.probe_layers, eager.spec.num_layers)
    assert graphs.layer_runs == layers[-1] + 1  # every probe layer ran from the bucket
    assert got.counters.probe_s > 0
    _same(got, want)


def test_a_missed_chunk_is_left_out_of_the_bucket_s_keys(make_setup):
    """A missed chunk's rows are not the probe's keys (``skip``): the bucket sees T' < T keys."""
    eager, fast, graphs, client = _engines(make_setup)
    plan = _prompt(client, eager, random_chunks(4, 24, seed=3), miss=1)
    assert any(not s.hit for s in plan.segments if s.kind == "chunk")
    _prepare(graphs, plan)
    _same(fast.blend(plan), eager.blend(plan))
    assert graphs.layer_runs > 0


def test_two_requests_of_one_bucket_each_get_their_own_result(make_setup):
    eager, fast, graphs, client = _engines(make_setup)
    plan_a = _prompt(client, eager, random_chunks(3, 24, seed=5))
    plan_b = _prompt(client, eager, random_chunks(3, 30, seed=6), query=[4, 5, 12, 13, 14, 15, 16])
    assert ProbeGraphs.key(10, plan_a.blend_end, ()) == ProbeGraphs.key(14, plan_b.blend_end, ())
    _prepare(graphs, plan_a)
    got_a, got_b, got_a2 = fast.blend(plan_a), fast.blend(plan_b), fast.blend(plan_a)
    _same(got_a, eager.blend(plan_a))
    _same(got_b, eager.blend(plan_b))
    _same(got_a2, got_a)


def test_the_product_s_fused_layers_run_the_bucket_too(make_setup):
    from blend.adapters.fused_llama import FusedLlamaAdapter

    eager, fast, graphs, client = _engines(make_setup, FusedLlamaAdapter(tiny_model("llama"), model_id="tiny-llama"))
    plan = _prompt(client, eager, random_chunks(3, 24, seed=7))
    _prepare(graphs, plan)
    _same(fast.blend(plan), eager.blend(plan))
    assert graphs.layer_runs > 0


def test_no_bucket_runs_the_eager_probe(make_setup):
    """Nothing prepared (or a prompt past ``max_tokens``): the eager probe, no capture in a request."""
    eager, fast, graphs, client = _engines(make_setup)
    plan = _prompt(client, eager, random_chunks(3, 24, seed=8))
    _same(fast.blend(plan), eager.blend(plan))
    assert graphs.layer_runs == 0 and graphs.stats()["buckets"] == []
    assert not graphs.prepare(10, 4096, (1, 2))  # keys past max_tokens' bucket
    assert graphs.ready(10, 4096, (1, 2)) is None


def test_ratio_one_with_graphs_equals_full_prefill(make_setup):
    eager, fast, graphs, client = _engines(make_setup)
    plan = _prompt(client, eager, random_chunks(3, 24, seed=9), ratio=1.0)
    _prepare(graphs, plan)
    got, full = fast.blend(plan), eager.prefill(list(plan.token_ids[:plan.blend_end]))
    assert_close(got.logits, full.logits, **F32_TOL)
    for a, b in zip(got.kv, full.kv, strict=True):
        assert_close(a, b, **F32_TOL)


def test_a_capture_that_fails_turns_graphs_off_and_blends_stay_right(make_setup, caplog):
    """No CUDA here: asking for capture fails at the first bucket, once, logged; the probe runs eagerly."""
    eager, client = make_setup("llama")
    graphs = ProbeGraphs(eager.model, eager.scale, max_tokens=512, capture=True)
    fast = BlendEngine(eager.model, client, probe_graphs=graphs)
    plan = _prompt(client, eager, random_chunks(3, 24, seed=10))
    layers = probe_layers_for(plan.probe_layers, eager.spec.num_layers)
    with caplog.at_level("WARNING", logger="blend.probe_graphs"):
        assert not graphs.prepare(12, plan.blend_end, layers)
        assert not graphs.prepare(12, plan.blend_end, layers)
    assert graphs.broken and sum("CUDA graphs" in r.message for r in caplog.records) == 1
    _same(fast.blend(plan), eager.blend(plan))
    assert graphs.layer_runs == 0


def test_begin_refuses_a_request_larger_than_its_bucket(make_setup):
    eager, _, graphs, _ = _engines(make_setup)
    assert graphs.prepare(10, 100, (1,))
    bucket = graphs.ready(10, 100, (1,))
    hidden = torch.zeros(129, eager.spec.hidden_size)
    pos = torch.arange(129)
    with pytest.raises(ValueError, match="do not fit"):
        graphs.begin(bucket, hidden, pos, pos, 5, 100)
    with pytest.raises(ValueError, match="do not fit"):
        graphs.begin(bucket, hidden[:5], pos[:5], pos[:5], 5, 129)


@pytest.mark.parametrize("miss", [None, 1])
def test_the_probe_s_mass_and_layer_buffers_equal_the_eager_probe_s(make_setup, monkeypatch, miss):
    """The probe's own outputs, not only the blend's: the blend writes every computed row again
    in each layer, so a wrong write-back of the probe's fresh K/V would not show in its result."""
    eager, fast, graphs, client = _engines(make_setup)
    plan = _prompt(client, eager, random_chunks(4, 24, seed=11), miss=miss)
    _prepare(graphs, plan)
    seen = {}
    real = qs.probe_query_mass

    def spy(*args, graphs=None, **kw):
        mass, buffers = yield from real(*args, graphs=graphs, **kw)
        seen["graphs" if graphs is not None and graphs.layer_runs else "eager"] = (
            mass.clone(), {i: b.clone() for i, b in buffers.items()})
        return mass, buffers

    monkeypatch.setattr(qs, "probe_query_mass", spy)
    eager.blend(plan)
    fast.blend(plan)
    (mass_g, bufs_g), (mass_e, bufs_e) = seen["graphs"], seen["eager"]
    assert_close(mass_g, mass_e, **F32_TOL)
    assert bufs_g.keys() == bufs_e.keys() and bufs_g
    rows = torch.ones(plan.blend_end, dtype=torch.bool)  # rows the probe defines (not a missed chunk's)
    for seg in plan.segments:
        if seg.kind == "chunk" and not seg.hit:
            rows[seg.start:seg.end] = False
    for i in bufs_e:
        assert_close(bufs_g[i][:, :plan.blend_end][:, rows], bufs_e[i][:, :plan.blend_end][:, rows], **F32_TOL)


def test_a_bucket_held_by_one_probe_sends_another_to_the_eager_probe(make_setup):
    """A vLLM worker interleaves blends layer by layer: request A pauses inside its probe while
    B blends in the same bucket. B probes eagerly; both get the eager result; the bucket is
    free again once A is done (and once a probe is abandoned)."""
    eager, fast, graphs, client = _engines(make_setup)
    plan_a = _prompt(client, eager, random_chunks(3, 24, seed=12))
    plan_b = _prompt(client, eager, random_chunks(3, 26, seed=13))
    _prepare(graphs, plan_a)
    layers = probe_layers_for(plan_a.probe_layers, eager.spec.num_layers)
    steps = fast.blend_steps(plan_a)
    with torch.no_grad():
        next(steps)  # A's first probe layer ran from the bucket; A holds it
    got_b = fast.blend(plan_b)
    assert graphs.layer_runs == 1
    got_a = run_steps(steps)
    _same(got_a, eager.blend(plan_a))
    _same(got_b, eager.blend(plan_b))
    assert graphs.layer_runs == layers[-1] + 1
    abandoned = fast.blend_steps(plan_b)
    with torch.no_grad():
        next(abandoned)
    abandoned.close()
    _same(fast.blend(plan_b), got_b)
    assert graphs.layer_runs == 2 * (layers[-1] + 1) + 1
