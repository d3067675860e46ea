"""The serving process's cost estimates (issue 34), fed scripted samples (no clock): the compute
fit finds the line the samples lie on, a tier that slows down in the middle of a run changes the
plan's choice within a bounded number of requests, and one that recovers is found again through
exploration."""

from __future__ import annotations

import pytest

from blend.cost import choose
from blend.plan import CHUNK, BlendPlan, Segment
from cluster.vllm.cost_samples import CostSamples, calibration_samples
from cluster.vllm.costs import EXPLORE_AFTER, CostEstimator, linear_keys

pytestmark = pytest.mark.unit

KV_BYTES = 20_000  # one token's KV in every layer, bytes
LAYERS = 8


def _plan(tiers, tokens=500) -> BlendPlan:
    segs, pos = [Segment("prefix", 0, 20)], 20
    for t in tiers:
        segs.append(Segment(CHUNK, pos, pos + tokens, hit=True, stored_positions=tuple(range(tokens)), tier=t))
        pos += tokens
    segs.append(Segment("query", pos, pos + 20))
    return BlendPlan(token_ids=tuple(range(pos + 20)), segments=tuple(segs), check_layers=(1,),
                     recompute_ratios=(0.15,), blend_end=pos)


def test_compute_fit_recovers_overhead_and_slope():
    est = CostEstimator(k_lin=1000.0)
    assert not est.compute_known
    for rows, keys in [(100, 1000), (500, 2000), (2000, 2000), (300, 4000), (4000, 4000)]:
        est.add_compute(rows, keys, 0.01 + 1e-7 * est.work(rows, keys))
    assert est.compute_known
    assert est.compute_s(1000, 3000) == pytest.approx(0.01 + 1e-7 * est.work(1000, 3000), rel=1e-6)


def test_one_sample_is_a_line_through_the_origin_and_bad_samples_are_skipped():
    est = CostEstimator(k_lin=0.0)
    est.add(CostSamples(compute=[(10, 10, float("nan"), "blend"), (10, 10, -1.0, "blend"), (0, 10, 1.0, "blend"),
                                 (10, 10, 1.0, "another kind")]))
    assert not est.compute_known
    est.add_compute(100, 100, 0.5)
    assert est.compute_s(200, 100) == pytest.approx(1.0)


def test_linear_keys_of_a_llama_layer():
    assert linear_keys(4096, 1024, 14336) == 4096 + 1024 + 1.5 * 14336


class _World:
    """A worker whose tiers take ``true_gbps`` and whose compute takes 1e-7 s per work unit:
    runs a plan as chosen and reports the samples a worker would."""

    def __init__(self, est: CostEstimator, true_gbps: dict[str, float]) -> None:
        self.est, self.true_gbps = est, true_gbps

    def request(self, plan: BlendPlan) -> tuple[str, ...]:
        choice = choose(plan, self.est, kv_bytes_per_token=KV_BYTES, num_layers=LAYERS, explore=self.est.explore())
        loaded: dict[str, int] = {}
        recomputed: dict[str, int] = {}
        by_tier: dict[str, int] = {}
        labels = choice.tiers if choice else tuple((i, s.tier, s.num_tokens, "load")
                                                   for i, s in enumerate(plan.segments) if s.hit)
        for _, tier, tokens, what in labels:
            if what == "load":
                loaded[tier] = loaded.get(tier, 0) + 1
                by_tier[tier] = by_tier.get(tier, 0) + tokens * KV_BYTES
            else:
                recomputed[tier] = recomputed.get(tier, 0) + 1
        self.est.note_plan(loaded, recomputed)
        compute = 1e-7 * self.est.work(300.0, plan.blend_end)
        samples = CostSamples(compute=[(300.0, plan.blend_end, compute, "blend")])
        if by_tier:  # layers staged ahead of a bounded ring: the last arrives after the compute
            transfer = sum(n / (self.true_gbps[t] * 1e9) for t, n in by_tier.items())
            samples.transfer.append((by_tier, max(transfer, compute), max(0.0, transfer - compute)))
        self.est.add(samples)
        return tuple(what for *_, what in labels)


def test_a_tier_that_slows_is_recomputed_within_a_few_requests_and_found_again_when_it_recovers():
    est = CostEstimator(k_lin=2000.0, overlap=1.0)  # the world's layers pipeline perfectly
    world = _World(est, {"host": 10.0, "disk": 2.0})
    plan = _plan(["host", "disk", "disk"])
    first = world.request(plan)  # compute unknown until this request's sample: everything loads
    assert first == ("load", "load", "load")
    for _ in range(3):
        assert world.request(plan) == ("load", "load", "load")  # disk at 2 GB/s is worth loading

    world.true_gbps["disk"] = 0.01  # the disk slows down 200x
    changed = None
    for n in range(1, 11):
        if world.request(plan) == ("load", "recompute", "recompute"):
            changed = n
            break
    assert changed is not None and changed <= 4, f"the choice changed after {changed} requests"

    world.true_gbps["disk"] = 2.0  # it recovers: only exploration loads a disk chunk again
    back = None
    for n in range(1, 4 * EXPLORE_AFTER):
        if world.request(plan) == ("load", "load", "load"):
            back = n
            break
    assert back is not None and back <= 2 * EXPLORE_AFTER, f"recovery seen after {back} requests"


def test_snapshot_names_every_tier_seen():
    est = CostEstimator(k_lin=1.0, priors={"disk": (0.0, 1e9)})
    est.add_transfer({"disk": 10**9}, 2.0)
    snap = est.snapshot()
    assert 0.5 < snap["tiers"]["disk"]["gbps"] < 1.0  # moved ALPHA of the way from 1 GB/s toward 0.5


def test_a_blends_fixed_cost_is_its_own_so_short_prompts_go_to_full_prefill():
    """Blends and prefills are fitted apart: a blend's fixed cost (launches, selection) makes
    full prefill the sooner way for a short prompt however cheap the tiers, not for a long one."""
    est = CostEstimator(k_lin=100.0)
    for rows, keys in [(100, 1000), (300, 2000), (900, 6000)]:
        est.add_compute(rows, keys, 0.05 + 1e-8 * est.work(rows, keys), "blend")
    for keys in (500, 1000, 2000, 6000):
        est.add_compute(keys, keys, 1e-8 * est.work(keys, keys), "prefill")
    assert est.snapshot()["blend_c0_s"] == pytest.approx(0.05) and est.snapshot()["prefill_c0_s"] == pytest.approx(0)
    short, long = _plan(["host"], tokens=300), _plan(["host"] * 16, tokens=2000)
    assert choose(short, est, kv_bytes_per_token=1, num_layers=LAYERS).full_prefill
    assert not choose(long, est, kv_bytes_per_token=1, num_layers=LAYERS).full_prefill


def test_a_blend_that_waited_for_its_layers_does_not_raise_the_price_of_the_next():
    """On a GPU a blend whose layers came late shows the wait in its host-side compute time:
    only the least excess over the prefill rate counts as a blend's fixed cost."""
    est = CostEstimator(k_lin=100.0)
    for keys in (500, 1000, 2000):
        est.add_compute(keys, keys, 1e-8 * est.work(keys, keys), "prefill")
    est.add_compute(300, 2000, 0.01 + 1e-8 * est.work(300, 2000), "blend")      # computed only
    est.add_compute(300, 2000, 0.9 + 1e-8 * est.work(300, 2000), "blend")       # waited 0.9 s
    assert est.blend_overhead_s() == pytest.approx(0.01)
    assert est.compute_s(300, 2000) == pytest.approx(0.01 + 1e-8 * est.work(300, 2000))


def test_a_pipe_that_kept_up_is_not_priced_at_the_computes_speed():
    """A transfer sample is an interval (the engine's wait .. the last layer's arrival): a
    source that reads when the engine asks delivers its last layer when the compute is done,
    however fast it is; the estimate moves only when the interval excludes it."""
    est = CostEstimator(k_lin=1.0, priors={"host": (0.0, 10e9)})
    for _ in range(20):  # 1 GB predicted at 0.1 s; the last layer came after 2 s, 0.05 s waited
        est.add_transfer({"host": 10**9}, 2.0, 0.05)
    assert est.snapshot()["tiers"]["host"]["gbps"] == pytest.approx(10.0)
    for _ in range(20):  # the engine waited 1 s: the pipe is slower than predicted
        est.add_transfer({"host": 10**9}, 2.0, 1.0)
    assert 1.0 <= est.snapshot()["tiers"]["host"]["gbps"] < 1.1
    for _ in range(20):  # and faster than predicted: the last layer came after 0.2 s
        est.add_transfer({"host": 10**9}, 0.2, 0.0)
    assert 4.9 < est.snapshot()["tiers"]["host"]["gbps"] <= 5.0
    est.add(CostSamples(transfer=[({"host": 10**9}, 0.1, 0.5)]))  # waited more than it took: skipped
    assert 4.9 < est.snapshot()["tiers"]["host"]["gbps"] <= 5.0



def test_the_overlap_is_learned_from_blends_that_loaded_and_computed():
    """A blend's wall time against the estimates' own compute and transfer for it: the sum of
    the two means no overlap, the longer alone a perfect pipeline. A blend whose transfer is a
    sliver of its compute says nothing about it and leaves it; bad samples are skipped."""
    est = CostEstimator(k_lin=1.0, priors={"disk": (0.0, 1e9)})
    for keys in (500, 1000, 2000):
        est.add_compute(keys, keys, 1e-6 * est.work(keys, keys), "prefill")
    est.add_compute(300, 2000, 1e-6 * est.work(300, 2000), "blend")
    c, t = est.compute_s(300, 2000), est.transfer_s({"disk": 3 * 10**8})
    assert 0.2 < c / t < 5 and est.overlap == pytest.approx(0.5)
    for _ in range(15):  # one after the other
        est.add(CostSamples(blends=[({"disk": 3 * 10**8}, 300.0, 2000, c, c + t)]))
    assert est.overlap < 0.01 and est.snapshot()["overlap"] == est.overlap
    for _ in range(15):  # a perfect pipeline
        est.add_blend({"disk": 3 * 10**8}, 300.0, 2000, c, max(c, t))
    assert est.overlap > 0.99
    est.add_blend({"disk": 1000}, 300.0, 2000, c, c * 10)  # transfer of 1 us under the compute
    est.add_blend({"disk": 3 * 10**8}, 300.0, 2000, c, float("nan"))
    est.add_blend({"disk": 3 * 10**8}, 0.0, 2000, c, c + t)
    assert est.overlap > 0.99


def test_reads_that_do_not_overlap_compute_turn_a_partial_plan_into_full_prefill():
    """The worker the H100 placement run met: disk reads and the recompute ran one after the
    other. Priced as a pipeline, half the chunks load; after a few blends measured as serial,
    the plan is full prefill (sooner than either)."""
    est = CostEstimator(k_lin=100.0, priors={"disk": (0.0, 1e9)}, overlap=1.0)
    per_work = 1e-8
    for keys in (500, 1000, 4000, 8000):
        est.add_compute(keys, keys, per_work * est.work(keys, keys), "prefill")
    plan = _plan(["disk"] * 16, tokens=500)
    kv = 40_000  # 8,000 tokens: 0.32 s of reads against 0.36 s of full prefill
    est.add_compute(1500, plan.blend_end, per_work * est.work(1500, plan.blend_end), "blend")
    first = choose(plan, est, kv_bytes_per_token=kv, num_layers=LAYERS)
    assert not first.full_prefill and 0 < len(first.recomputed) < 16
    for _ in range(12):
        choice = choose(plan, est, kv_bytes_per_token=kv, num_layers=LAYERS)
        if choice.full_prefill:
            break
        tokens_loaded = (16 - len(choice.recomputed)) * 500
        loaded = {"disk": tokens_loaded * kv}
        rows = 20 + (8000 - tokens_loaded) + 0.15 * tokens_loaded
        compute = est.compute_s(rows, plan.blend_end)
        est.add(CostSamples(blends=[(loaded, rows, plan.blend_end, compute, compute + est.transfer_s(loaded))]))
    assert choice.full_prefill, f"still {len(choice.recomputed)} of 16 recomputed, overlap {est.overlap:.2f}"


def test_a_blend_whose_loads_may_have_kept_the_device_waiting_does_not_set_the_fixed_cost():
    """On a GPU the host's compute time of a blend that read a slow tier holds the device's
    wait for its layers: such blends feed the compute fit, not a blend's fixed cost (32 of them
    in a row priced it at 0.10-0.15 s on an H100, above a whole 4K blend)."""
    est = CostEstimator(k_lin=100.0, priors={"disk": (0.0, 1e9), "gpu": (0.0, 1e12)})
    for keys in (500, 1000, 2000):
        est.add_compute(keys, keys, 1e-8 * est.work(keys, keys), "prefill")
    base = 1e-8 * est.work(300, 2000)
    est.add(CostSamples(blends=[({"gpu": 10**6}, 300.0, 2000, 0.01 + base, 0.01 + base)]))
    assert est.blend_overhead_s() == pytest.approx(0.01)
    for _ in range(40):  # 0.5 s of reads each: the host saw 0.5 s of "compute"
        est.add(CostSamples(blends=[({"disk": 5 * 10**8}, 300.0, 2000, 0.5 + base, 0.5 + base)]))
    assert est.blend_overhead_s() == pytest.approx(0.01)


def _h100_prefill(est: CostEstimator, tokens: int) -> float:
    """An H100's prefill of the 7B-shaped model (2026-12-07): launch-bound up to ~1K tokens
    (20 ms), then 9e-10 s per unit of work (0.23 s at 8K tokens)."""
    return max(0.02, 9e-10 * est.work(tokens, tokens))


def test_the_row_rate_is_the_least_cost_per_work_among_prefills():
    """Short prefills sit on the launch-bound floor: a line through prefills of 128-2,048
    tokens (the old fit) priced 8K tokens at 0.15 s; the least seconds per unit of work prices
    it at the 0.23 s it takes, and a blend at that rate plus its fixed cost, once."""
    est = CostEstimator(k_lin=linear_keys(4096, 1024, 14336))
    assert est.row_rate() == 0.0  # nothing measured
    for n in (128, 256, 512, 1024, 2048):
        est.add_compute(n, n, _h100_prefill(est, n), "prefill")
    assert est.row_rate() == pytest.approx(9e-10)
    snap = est.snapshot()
    line = snap["prefill_c0_s"] + snap["prefill_s_per_work"] * est.work(8257, 8257)  # the old price
    assert line < 0.18 and est.prefill_s(8257) == pytest.approx(0.23, abs=0.005)
    assert est.prefill_s(100) == pytest.approx(0.02)  # the floor
    fixed = 0.05  # launches and the probe
    for rows in (1294, 1294, 7774):
        est.add_compute(rows, 8257, fixed + 9e-10 * est.work(rows, 8257), "blend")
    assert est.blend_overhead_s() == pytest.approx(fixed)
    assert est.compute_s(4776, 8257) == pytest.approx(fixed + 9e-10 * est.work(4776, 8257))


def test_the_start_up_calibration_outlives_the_passage_prefills_that_follow():
    """A worker's later prefills are passage-sized and sit on the launch-bound floor: 40 of
    them after the 1K-4K calibration leave the row rate where the calibration put it (the
    floor's 512-token prefills alone would price an 8K prefill at ~0.37 s)."""
    est = CostEstimator(k_lin=linear_keys(4096, 1024, 14336))
    for n in (1024, 2048, 4096):
        est.add_compute(n, n, _h100_prefill(est, n), "prefill")
    for _ in range(40):
        est.add_compute(512, 512, _h100_prefill(est, 512), "prefill")
    assert est.row_rate() == pytest.approx(9e-10)
    assert est.prefill_s(8257) == pytest.approx(0.23, abs=0.005)
    assert est.prefill_s(300) == pytest.approx(0.02)  # the floor still comes from every prefill
    alone = CostEstimator(k_lin=linear_keys(4096, 1024, 14336))
    alone.add_compute(512, 512, _h100_prefill(alone, 512), "prefill")
    assert alone.prefill_s(8257) > 0.3  # what the window would have come to


def test_a_split_is_chosen_where_recomputing_the_slow_half_is_sooner():
    """The H100's ``mixed`` placement at 8K tokens (2026-12-07) in its own numbers: half the
    chunks in host memory (56 GB/s), half on a 1.9 GB/s disk; load-all blends take 0.08 s.
    Recomputing the disk half while loading the host half is priced at ~0.18 s against 0.23 s
    of full prefill and ~0.35 s of loading all: the split. Before, the least-ratio row factor
    (3-8) and the fitted line's prefill price (0.15 s) both sent it to full prefill."""
    est = CostEstimator(linear_keys(4096, 1024, 14336), priors={"host": (0.001, 56e9), "disk": (0.005, 1.9e9)})
    for n in (128, 256, 512, 1024, 2048):
        est.add_compute(n, n, _h100_prefill(est, n), "prefill")
    keys = 20 + 16 * 512
    for t in (0.080, 0.082, 0.090, 0.085):
        est.add_compute(1294, keys, t, "blend")
    choice = choose(_plan(["host"] * 8 + ["disk"] * 8, tokens=512), est, kv_bytes_per_token=131072, num_layers=32)
    assert not choice.full_prefill and choice.recomputed == tuple(range(9, 17))
    assert choice.blend_s == pytest.approx(0.18, abs=0.02) and choice.blend_s < choice.full_s < choice.always_load_s


def test_calibration_prefills_longer_prompts_once_each():
    """What a worker measures at start-up: one sample per calibration length within the
    context window, each the second of two prefills (the first warms the shape)."""
    calls: list[int] = []

    class _Engine:
        spec = type("Spec", (), {"vocab_size": 50})()

        def prefill(self, ids, want_logits=True):
            calls.append(len(ids))
            assert not want_logits and all(0 < i < 50 for i in ids)
            counters = type("C", (), {"recomputed_tokens_per_layer": [len(ids)] * 2, "compute_s": 1e-3 * len(ids),
                                      "transfer_s": 0.0, "num_hit_segments": 0, "full_prefill_reason": None})()
            return type("R", (), {"counters": counters})()

    samples = calibration_samples(_Engine(), max_tokens=2048)
    assert calls == [1024, 1024, 2048, 2048]
    assert [(rows, keys, kind) for rows, keys, _, kind in samples.compute] == [(1024, 1024, "prefill"),
                                                                               (2048, 2048, "prefill")]
    assert not calibration_samples(_Engine(), max_tokens=512)


def test_a_tier_faster_than_its_prior_is_priced_at_once():
    """One tier whose bytes all arrived well before the prediction: the estimate goes to the
    bound at once (four requests at full prefill on the H100 before); a slower one moves ALPHA
    of the way, and so does a tier sharing a multi-tier interval."""
    est = CostEstimator(k_lin=1.0, priors={"host": (0.0, 10e9), "disk": (0.0, 1e9)})
    est.add_transfer({"host": 2 * 10**9}, 0.035, 0.0)  # 2 GB in 35 ms: at least 57 GB/s
    assert est.snapshot()["tiers"]["host"]["gbps"] == pytest.approx(2e9 / 0.035 / 1e9)
    est.add_transfer({"disk": 10**9}, 2.0, 2.0)  # 1 GB took 2 s, 1 predicted: 30% of the way
    assert 0.75 < est.snapshot()["tiers"]["disk"]["gbps"] < 0.8
    mixed = CostEstimator(k_lin=1.0, priors={"host": (0.0, 10e9), "disk": (0.0, 1e9)})
    mixed.add_transfer({"host": 10**9, "disk": 10**9}, 0.11, 0.0)  # both sooner: shares move 30%
    assert 10.0 < mixed.snapshot()["tiers"]["host"]["gbps"] < 20.0


def test_chunks_the_gpu_tier_held_are_not_a_transfer_sample():
    """H100, 4K: chunks the worker's gpu tier served (looked up as ``host``: the scheduler
    cannot see that tier) made the host tier look 144 GB/s, so host_cold and mixed requests
    were priced at half their time. Their bytes are left out; all of them: no transfer sample."""
    import dataclasses
    from types import SimpleNamespace

    from cluster.vllm.cost_samples import samples_of
    from tiers.keys import ChunkKey

    plan = _plan(["host", "host", "disk"])
    keyed = iter(range(3))
    plan = dataclasses.replace(plan, segments=tuple(
        dataclasses.replace(s, key=ChunkKey("ns", "seg", f"{next(keyed):032x}")) if s.hit else s
        for s in plan.segments))
    hits = [s.key for s in plan.hit_segments]
    c = SimpleNamespace(transfer_s=0.05, load_wait_s=0.01, full_prefill_reason=None, num_hit_segments=3,
                        recomputed_tokens_per_layer=[300] * LAYERS, compute_s=0.02)
    every = samples_of(c, plan.blend_end, plan, KV_BYTES)
    assert every.transfer == [({"host": 1000 * KV_BYTES, "disk": 500 * KV_BYTES}, 0.05, 0.01, None)]
    some = samples_of(c, plan.blend_end, plan, KV_BYTES, local={hits[0]})
    assert some.transfer == [({"host": 500 * KV_BYTES, "disk": 500 * KV_BYTES}, 0.05, 0.01, None)]
    assert some.blends[0][0] == {"host": 500 * KV_BYTES, "disk": 500 * KV_BYTES}
    none = samples_of(c, plan.blend_end, plan, KV_BYTES, local=set(hits))
    assert none.transfer == [] and none.blends == [] and none.compute == [(300.0, plan.blend_end, 0.02, "blend")]
    # chunks the source could not hold, or had lost when read, were computed: no transfer either
    c.unfit_keys, c.lost_keys = (hits[0],), (hits[2],)
    assert samples_of(c, plan.blend_end, plan, KV_BYTES).transfer == [({"host": 500 * KV_BYTES}, 0.05, 0.01, None)]


def test_a_tier_that_recovered_is_seen_by_the_sources_busy_time_though_its_read_hid_under_compute():
    """H100 settling run: a throttled tier back at 20 GB/s was not loaded again within 24
    requests. Its explored chunk (~3 ms) arrived inside a blend whose last layer came after
    ~0.1 s of compute, an interval holding the old prediction, so nothing moved. With the
    source's busy seconds (``transfer_busy_s``, a point) the estimate goes to the new speed
    at once; through ``samples_of`` and ``CostEstimator.add`` as the worker sends them."""
    from types import SimpleNamespace

    from cluster.vllm.cost_samples import samples_of

    def slowed() -> CostEstimator:
        est = CostEstimator(k_lin=1.0, priors={"disk": (0.0, 1e9)})
        for _ in range(20):
            est.add_transfer({"disk": 10**9}, 20.0, 20.0)  # 1 GB in 20 s: 0.05 GB/s
        assert est.snapshot()["tiers"]["disk"]["gbps"] == pytest.approx(0.05, rel=0.05)
        return est

    plan = _plan(["disk"], tokens=500)  # one explored chunk: 10 MB, 0.2 s at the slowed price
    c = SimpleNamespace(transfer_s=0.5, load_wait_s=0.0, full_prefill_reason=None, num_hit_segments=1,
                        recomputed_tokens_per_layer=[300] * LAYERS, compute_s=0.5, transfer_busy_s=0.005)
    interval_only = slowed()
    interval_only.add(samples_of(SimpleNamespace(**{**vars(c), "transfer_busy_s": None}), plan.blend_end, plan,
                                 KV_BYTES))
    assert interval_only.snapshot()["tiers"]["disk"]["gbps"] == pytest.approx(0.05, rel=0.05)  # the old gap
    est = slowed()
    samples = samples_of(c, plan.blend_end, plan, KV_BYTES)
    assert samples.transfer == [({"disk": 500 * KV_BYTES}, 0.5, 0.0, 0.005)]
    est.add(samples)
    assert est.snapshot()["tiers"]["disk"]["gbps"] == pytest.approx(500 * KV_BYTES / 0.005 / 1e9)
    # a busy time past the interval's end is no sample of more than the interval
    late = slowed()
    late.add_transfer({"disk": 500 * KV_BYTES}, 0.01, 0.0, busy=5.0)
    assert late.snapshot()["tiers"]["disk"]["gbps"] == pytest.approx(500 * KV_BYTES / 0.01 / 1e9)
    # samples of three fields (no busy time) are read as before
    old = slowed()
    old.add(CostSamples(transfer=[({"disk": 10**9}, 20.0, 20.0)]))
    assert old.snapshot()["tiers"]["disk"]["gbps"] == pytest.approx(0.05, rel=0.05)
