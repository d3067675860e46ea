"""Blend engine against full prefill (the oracle) on tiny random-weight models, float32.

Tolerance: F32_TOL (see tests/factories.py) — same math, different summation order only.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch.testing import assert_close

from tests.factories import F32_TOL, blend_prompt, plan_for, random_chunks, store_chunks

pytestmark = pytest.mark.unit

MODEL_TYPES = ["llama", "mistral", "qwen2"]


def _hf_reference(adapter, ids):
    """KV ([2, T, H, D] per layer) and last logits from HF's own forward (SDPA)."""
    with torch.no_grad():
        out = adapter.model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    kv = [torch.stack((cache.layers[i].keys[0].transpose(0, 1), cache.layers[i].values[0].transpose(0, 1)))
          for i in range(adapter.spec.num_layers)]
    return kv, out.logits[0, -1].float()


def _setup(make_setup, model_type="llama", num_chunks=3, chunk_len=24, **kw):
    engine, client = make_setup(model_type, **kw)
    chunks = random_chunks(num_chunks, chunk_len)
    store_chunks(engine, client, chunks)
    return engine, client, chunks


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_prefill_matches_hf_forward(make_setup, model_type):
    engine, _ = make_setup(model_type)
    ids = random_chunks(1, 40)[0]
    res = engine.prefill(ids)
    kv_ref, logits_ref = _hf_reference(engine.model, ids)
    for got, want in zip(res.kv, kv_ref, strict=True):
        assert_close(got, want, **F32_TOL)
    assert_close(res.logits, logits_ref, **F32_TOL)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_ratio_one_reproduces_full_prefill(make_setup, model_type):
    """per-model-accuracy-gate: ratio 1.0 = full prefill's KV and logits; the blend path ran."""
    engine, client, chunks = _setup(make_setup, model_type)
    ids, spans = blend_prompt([1, 2, 3], [chunks[2], chunks[0], chunks[1]], [4, 5, 6, 9])
    plan = plan_for(ids, spans, client, ratio=1.0)
    res = engine.blend(plan)
    full = engine.prefill(ids)
    c = res.counters
    assert c.full_prefill_reason is None
    assert c.num_hit_segments == 3 and c.reused_tokens == 72
    assert c.selected_tokens == 72
    assert c.recomputed_tokens_per_layer == [len(ids)] * engine.spec.num_layers
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **F32_TOL)
    assert_close(res.logits, full.logits, **F32_TOL)


def test_layers_up_to_check_layer_match_full_prefill(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2], chunks, [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15, check_layers=(2,))
    res = engine.blend(plan)
    full = engine.prefill(ids)
    for layer in range(3):
        assert_close(res.kv[layer], full.kv[layer], **F32_TOL)
    # Above the check layer the reused rows are not full prefill's: blending did something.
    assert not torch.allclose(res.kv[3], full.kv[3], **F32_TOL)
    assert res.counters.recomputed_tokens_per_layer[:3] == [len(ids)] * 3
    assert res.counters.recomputed_tokens_per_layer[3] < len(ids)


def test_unselected_rows_keep_cached_kv_bit_for_bit(make_setup):
    """ratio 0.15: unselected reused rows above the check layer hold the cached V and the
    engine's re-rotated cached K exactly; selected rows hold fresh KV."""
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], [chunks[1], chunks[2], chunks[0]], [4, 5, 6])
    plan = plan_for(ids, spans, client, ratio=0.15)
    res = engine.blend(plan)
    c = res.counters
    assert c.reused_tokens == 72
    assert c.selected_tokens == 11  # ceil(0.15 * 72)
    computed = set(res.recompute_idx.tolist())
    assert len(computed) == c.computed_tokens + c.selected_tokens
    hits = plan.hit_segments
    for layer in range(2, engine.spec.num_layers):
        for seg in hits:
            stored = client.fetch_layer([seg.key], layer).result()[0]  # [2, n, H, D]
            rows = torch.arange(seg.start, seg.end)
            k_rot = engine.model.rotate_k(stored[0], torch.tensor(seg.stored_positions), rows)
            for j, row in enumerate(rows.tolist()):
                if row in computed:
                    continue
                assert torch.equal(res.kv[layer][1, row], stored[1, j])
                assert torch.equal(res.kv[layer][0, row], k_rot[j])
    assert c.recomputed_tokens_per_layer[2:] == [len(computed)] * (engine.spec.num_layers - 2)


@pytest.mark.parametrize("score", ["k", "v", "kv"])
def test_selected_rows_are_the_top_deviation(make_setup, score):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6])
    plan = plan_for(ids, spans, client, ratio=0.25, selection=f"{score}_deviation")
    res = engine.blend(plan)
    full = engine.prefill(ids)
    # At the check layer (1) the fresh K and V equal full prefill's.
    reused = [r for s in plan.hit_segments for r in range(s.start, s.end)]
    cached = torch.zeros_like(full.kv[1])
    for seg in plan.hit_segments:
        stored = client.fetch_layer([seg.key], 1).result()[0]
        cached[0, seg.start:seg.end] = engine.model.rotate_k(
            stored[0], torch.tensor(seg.stored_positions), torch.arange(seg.start, seg.end))
        cached[1, seg.start:seg.end] = stored[1]
    dev_k, dev_v = ((full.kv[1][:, reused] - cached[:, reused]).square().sum(dim=(2, 3)))
    dev = {"k": dev_k, "v": dev_v, "kv": dev_k + dev_v}[score]
    expect = {reused[i] for i in torch.topk(dev, res.counters.selected_tokens).indices.tolist()}
    assert expect <= set(res.recompute_idx.tolist())


def test_threshold_drops_low_scorers(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6])
    base = engine.blend(plan_for(ids, spans, client, ratio=0.5))
    high = engine.blend(plan_for(ids, spans, client, ratio=0.5, thresholds=(1e30,)))
    assert base.counters.selected_tokens == 36
    assert high.counters.selected_tokens == 0


def test_second_check_layer_shrinks_the_set(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6])
    from blend.config import BlendConfig
    from blend.planner import make_plan
    from tests.factories import NAMESPACE
    plan = make_plan(ids, spans, NAMESPACE, client,
                     BlendConfig(check_layers=(1, 2), recompute_ratios=(0.5, 0.2), min_tokens=0,
                                 selection="k_deviation"),
                     query_to_engine=True)
    res = engine.blend(plan)
    per_layer = res.counters.recomputed_tokens_per_layer
    always = len(ids) - 72
    assert per_layer[:2] == [len(ids)] * 2
    assert per_layer[2] == always + 36          # computed at check layer 2: the first set
    assert per_layer[3] == always + 15          # ceil(0.2 * 72)
    assert res.counters.selected_tokens == 15


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_full_hit_reordered(make_setup, order):
    """All permutations of 3 cached chunks: every chunk hits; ratio 1.0 = full prefill."""
    engine, client, chunks = _setup(make_setup, chunk_len=16)
    ids, spans = blend_prompt([1, 2], [chunks[i] for i in order], [4, 5, 6])
    plan = plan_for(ids, spans, client, ratio=1.0)
    assert len(plan.hit_segments) == 3
    res = engine.blend(plan)
    assert res.counters.num_hit_segments == 3 and res.counters.reused_tokens == 48
    full = engine.prefill(ids)
    assert_close(res.logits, full.logits, **F32_TOL)
    assert_close(res.kv[-1], full.kv[-1], **F32_TOL)
    again = engine.blend(plan_for(ids, spans, client, ratio=1.0))  # the same prompt twice
    assert torch.equal(again.logits, res.logits)


def test_hits_after_a_miss(make_setup):
    engine, client, chunks = _setup(make_setup, num_chunks=3)
    new = random_chunks(1, 24, seed=99)[0]
    ids, spans = blend_prompt([1, 2, 3], [new, chunks[2], chunks[1], chunks[0]], [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15)
    assert [s.hit for s in plan.segments if s.kind == "chunk"] == [False, True, True, True]
    res = engine.blend(plan)
    c = res.counters
    assert c.num_hit_segments == 3 and c.reused_tokens == 72
    assert c.computed_tokens == len(ids) - 72   # prefix, separators, c4, query
    assert c.selected_tokens == 11
    ratio_one = engine.blend(plan_for(ids, spans, client, ratio=1.0))
    assert_close(ratio_one.logits, engine.prefill(ids).logits, **F32_TOL)


def test_recompute_actually_happens(make_setup, caplog):
    engine, client, chunks = _setup(make_setup, num_chunks=6, chunk_len=50)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    with caplog.at_level("DEBUG", logger="blend.engine"):
        res = engine.blend(plan_for(ids, spans, client, ratio=0.15, min_tokens=256))
    c = res.counters
    assert c.reused_tokens == 300 and c.selected_tokens == 45
    assert c.load_wait_s >= 0 and c.compute_s > 0
    assert "reused=300" in caplog.text and "selected=45" in caplog.text


@pytest.mark.parametrize("selection", ["k_deviation", "query_attention"])
def test_a_chunk_lost_between_lookup_and_read_is_computed_not_the_whole_request(make_setup, selection):
    """Found at lookup, gone at its first read (evicted, a shard restarted): the request is
    blended again with that chunk computed, as if it had missed; the rest still reused."""
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6])
    plan = plan_for(ids, spans, client, ratio=0.15, selection=selection)
    lost = plan.hit_segments[1]
    client.delete([lost.key])  # gone between lookup and fetch
    res = engine.blend(plan)
    c = res.counters
    assert c.full_prefill_reason is None and c.lost_segments == 1 and c.lost_keys == (lost.key,)
    assert c.num_hit_segments == len(plan.hit_segments) - 1 and c.reused_tokens > 0
    as_miss = plan.recomputing([plan.segments.index(lost)])
    assert_close(res.logits, engine.blend(as_miss).logits, **F32_TOL)  # the oracle of a miss
    all_lost = engine.blend(dataclasses.replace(plan, recompute_ratios=(1.0,)))
    assert_close(all_lost.logits, engine.prefill(ids).logits, **F32_TOL)  # ratio 1.0: full prefill


def test_a_second_loss_is_full_prefill(make_setup):
    """Blended again once: a chunk lost in the second blend sends the request to full prefill."""
    engine, client, chunks = _setup(make_setup, num_chunks=4)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15)  # k_deviation: layer 0 computed, 1 read
    a, b = plan.hit_segments[0].key, plan.hit_segments[1].key
    client.delete([a])
    steps = engine.blend_steps(plan)
    with torch.no_grad():
        assert [next(steps), next(steps)] == [0, 0]  # layer 1 lost a: blended again from 0
    client.delete([b])
    rest, res = _step_all(steps)
    c = res.counters
    assert "could not be read" in c.full_prefill_reason and c.lost_segments == 1 and c.lost_keys == (a,)
    assert rest[-engine.spec.num_layers:] == list(range(engine.spec.num_layers))
    assert_close(res.logits, engine.prefill(ids).logits, **F32_TOL)


def test_every_chunk_lost_is_full_prefill(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15)
    client.delete([s.key for s in plan.hit_segments])
    res = engine.blend(plan)
    c = res.counters
    assert c.num_hit_segments == 0 and c.reused_tokens == 0 and c.lost_segments == 0
    assert "could not be read" in c.full_prefill_reason
    assert_close(res.logits, engine.prefill(ids).logits, **F32_TOL)


class _Fitting:
    """The engine's source with ``fit_request`` (as over a cache agent's arena): ``room``
    bytes, filled in prompt order; records what it was asked."""

    def __init__(self, client, room: int) -> None:
        self.client, self.room, self.asked = client, room, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def fit_request(self, keys, nbytes):
        self.asked.append((list(keys), list(nbytes)))
        room, out = self.room, []
        for n in nbytes:
            out.append(n <= room)
            room -= n if n <= room else 0
        return out


def test_hits_the_source_cannot_hold_at_once_are_computed_not_a_fallback(make_setup):
    """Issue 32 (H100, 32K tokens over a 4 GiB agent arena): hits beyond the source's room
    were misses mid-blend and the whole request ran again as full prefill (1.2x of it). Now
    they are computed from the start: the blend equals the plan with those chunks recomputed."""
    from blend.engine import BlendEngine

    engine, client, chunks = _setup(make_setup, num_chunks=3)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15)
    spec = engine.spec
    per_chunk = 24 * 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # float32
    source = _Fitting(client, room=2 * per_chunk - 1)  # one chunk and a bit
    res = BlendEngine(engine.model, source).blend(plan)
    assert source.asked == [([s.key for s in plan.hit_segments], [per_chunk] * 3)]
    c = res.counters
    assert c.full_prefill_reason is None and c.unfit_segments == 2 and c.num_hit_segments == 1
    assert c.unfit_keys == tuple(s.key for s in plan.hit_segments[1:])  # left out of transfer samples
    hits = [i for i, s in enumerate(plan.segments) if s.hit]
    want = engine.blend(plan.recomputing(hits[1:]))
    assert torch.equal(res.logits, want.logits)
    assert all(torch.equal(a, b) for a, b in zip(res.kv, want.kv, strict=True))
    none = BlendEngine(engine.model, _Fitting(client, room=0)).blend(plan)
    assert none.counters.full_prefill_reason == "the source holds no hit chunk at once"
    assert_close(none.logits, engine.prefill(ids).logits, **F32_TOL)


def test_a_layer_never_delivered_is_full_prefill_after_load_timeout(make_setup):
    """Issue 20: a cached layer that never arrives (a source whose futures never resolve) costs
    at most ``load_timeout_s`` (``BlendConfig``'s default, 2 s, is the engine's), then the
    request is full prefill; every pending read is cancelled."""
    from concurrent.futures import Future

    from blend.config import BlendConfig
    from blend.engine import BlendEngine

    engine, client, chunks = _setup(make_setup)
    assert BlendEngine(engine.model).load_timeout_s == BlendConfig().load_timeout_s == 2.0
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15)
    pending: list[Future] = []

    def never(keys, layer_idxs):
        pending.extend(Future() for _ in layer_idxs)
        return pending[-len(layer_idxs):]

    client.fetch_layers = never
    res = BlendEngine(engine.model, client, load_timeout_s=0.05).blend(plan)
    assert res.counters.full_prefill_reason is not None and res.counters.load_wait_s >= 0.05
    assert_close(res.logits, engine.prefill(ids).logits, **F32_TOL)
    assert pending and all(f.cancelled() for f in pending)


def test_forced_recompute(make_setup):
    import dataclasses

    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15)
    first = plan.hit_segments[0].start
    forced = dataclasses.replace(plan, forced_recompute=(first, first + 3))
    res = engine.blend(forced)
    assert res.counters.selected_tokens == 2
    assert {first, first + 3} <= set(res.recompute_idx.tolist())
    assert first + 1 not in set(res.recompute_idx.tolist())


def test_on_layer_sees_every_final_layer(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    seen = {}
    res = engine.blend(plan_for(ids, spans, client), on_layer=lambda i, kv: seen.__setitem__(i, kv.clone()))
    assert sorted(seen) == list(range(engine.spec.num_layers))
    for i, kv in seen.items():
        assert torch.equal(kv, res.kv[i])


def test_query_left_to_the_serving_engine(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6])
    plan = plan_for(ids, spans, client, ratio=1.0, query_to_engine=False)
    assert plan.blend_end == len(ids) - 3
    res = engine.blend(plan, want_logits=False)
    assert res.logits is None and res.kv[0].shape[1] == plan.blend_end
    full = engine.prefill(ids[:plan.blend_end], want_logits=False)
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **F32_TOL)


def test_every_cached_layer_is_requested_once_before_the_check_layer_is_computed(make_setup):
    """§5 pipelining: the engine asks its source for every layer from the first check layer
    up in one ``fetch_layers`` call, before it computes the check layer, and takes each
    layer's result only when it reaches that layer. The wrapped model records, at each
    ``qkv(l)``, which layers' results had been taken; the source records its calls."""
    from concurrent.futures import Future

    engine, client, chunks = _setup(make_setup)
    calls, taken = [], []

    class Tracked(Future):
        def __init__(self, inner, layer_idx):
            super().__init__()
            self.inner, self.layer_idx = inner, layer_idx

        def result(self, timeout=None):
            taken.append(self.layer_idx)
            return self.inner.result(timeout)

    class Source:
        def lookup(self, keys):
            return client.lookup(keys)

        def fetch_layers(self, keys, layer_idxs):
            calls.append(list(layer_idxs))
            return [Tracked(f, i) for f, i in zip(client.fetch_layers(keys, layer_idxs), layer_idxs, strict=True)]

    class Model:
        def __init__(self, inner):
            self.inner, self.spec, self.scale = inner, inner.spec, inner.scale
            self.device, self.dtype = inner.device, inner.dtype
            self.seen = {}

        def qkv(self, layer_idx, *a):
            self.seen[layer_idx] = (len(calls), list(taken))
            return self.inner.qkv(layer_idx, *a)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    from blend.engine import BlendEngine

    model = Model(engine.model)
    pipelined = BlendEngine(model, Source())
    ids, spans = blend_prompt([1, 2], chunks, [4, 5])
    res = pipelined.blend(plan_for(ids, spans, client, ratio=0.15))
    num_layers = engine.spec.num_layers
    assert calls == [list(range(1, num_layers))]  # check layer 1: layer 0 never touches the cache
    assert model.seen[1] == (1, [])                # asked before the check layer, nothing taken yet
    for layer in range(2, num_layers):             # layer l's result taken only when l is reached
        assert model.seen[layer] == (1, list(range(1, layer)))
    assert taken == list(range(1, num_layers))
    assert_close(res.logits, engine.blend(plan_for(ids, spans, client, ratio=0.15)).logits, rtol=0, atol=0)


def _step_all(steps, between=None):
    """Drive a ``blend_steps`` generator to its end; ``between()`` after every step.
    Returns (the layer indices it yielded, its result)."""
    layers = []
    with torch.no_grad():
        while True:
            try:
                layers.append(next(steps))
            except StopIteration as stop:
                return layers, stop.value
            if between is not None:
                between()


def test_blend_steps_interleaved_equals_blend(make_setup):
    """vLLM's async-load path slices a blend across engine steps: stepped one layer at a time,
    with other model work (a chunk's prefill, as the connector's stores) between the steps,
    the result is bit for bit the one-call blend's."""
    from blend.engine import run_steps

    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], [chunks[1], chunks[2], chunks[0]], [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15)
    whole = engine.blend(plan)
    # other model work (a chunk's prefill) between the steps
    layers, stepped = _step_all(engine.blend_steps(plan), lambda: engine.prefill(chunks[0], want_logits=False))
    assert layers == list(range(engine.spec.num_layers))
    assert stepped.counters.full_prefill_reason is None and stepped.counters.selected_tokens > 0
    assert stepped.counters.recomputed_tokens_per_layer == whole.counters.recomputed_tokens_per_layer
    for got, want in zip(stepped.kv, whole.kv, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(stepped.logits, whole.logits)
    assert torch.equal(run_steps(engine.blend_steps(plan)).logits, whole.logits)


def test_blend_steps_closed_midway_cancels_and_engine_stays_usable(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15)
    whole = engine.blend(plan)
    steps = engine.blend_steps(plan)
    with torch.no_grad():
        assert [next(steps), next(steps), next(steps)] == [0, 1, 2]
    steps.close()  # abandoned (the request was aborted)
    with pytest.raises(StopIteration):
        next(steps)
    assert torch.equal(engine.blend(plan).logits, whole.logits)


def test_blend_steps_blend_again_midway(make_setup):
    """A chunk gone between two steps: blended again with it computed, its layers stepped from 0
    again; every chunk gone: full prefill, the same way."""
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    plan = plan_for(ids, spans, client, ratio=0.15)
    as_miss = engine.blend(plan.recomputing([plan.segments.index(plan.hit_segments[0])]))
    steps = engine.blend_steps(plan)
    with torch.no_grad():
        first = next(steps)
    client.delete([plan.hit_segments[0].key])
    rest, res = _step_all(steps)
    assert first == 0 and res.counters.full_prefill_reason is None and res.counters.lost_segments == 1
    assert rest[-engine.spec.num_layers:] == list(range(engine.spec.num_layers))
    assert_close(res.logits, as_miss.logits, **F32_TOL)

    steps = engine.blend_steps(plan)
    with torch.no_grad():
        first = next(steps)
    client.delete([s.key for s in plan.hit_segments])
    rest, res = _step_all(steps)
    assert first == 0 and "could not be read" in res.counters.full_prefill_reason
    assert rest[-engine.spec.num_layers:] == list(range(engine.spec.num_layers))
    assert_close(res.logits, engine.prefill(ids).logits, **F32_TOL)


def test_compute_time_ends_when_the_device_is_done(make_setup, monkeypatch):
    """The device wait runs once, at the end of a prefill and of a blend, and its time is the
    request's compute (a GPU prefill without logits would otherwise time only the launches)."""
    import blend.engine as engine_mod

    engine, client, chunks = _setup(make_setup, num_chunks=3, chunk_len=24)
    clock = {"now": 0.0, "waits": 0}

    def device_done():  # stands in for torch.cuda.synchronize: the device's queued work takes 5 s
        clock["waits"] += 1
        clock["now"] += 5.0

    monkeypatch.setattr(engine_mod.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(engine, "_device_done", device_done)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5])
    full = engine.prefill(ids, want_logits=False)
    assert clock["waits"] == 1 and full.counters.compute_s == 5.0
    res = engine.blend(plan_for(ids, spans, client, ratio=0.15))
    assert res.counters.full_prefill_reason is None and res.counters.num_hit_segments == 3
    assert clock["waits"] == 2 and res.counters.compute_s == 5.0 - res.counters.load_wait_s
