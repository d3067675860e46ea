"""The serving process's estimates of what loading and computing cost (issue 34), kept up to
date from its own requests: :class:`CostEstimator` implements :class:`blend.cost.CostEstimates`.

* **Compute.** A row costs ``r * W`` (:meth:`CostEstimator.row_rate`): full prefill is
  ``max(floor, r * W)`` and a blend ``r * W`` plus a blend's own fixed cost (launches, the
  probe, selection: the least
  excess over ``r * W`` among the last :data:`BLEND_WINDOW` blends whose predicted transfer was
  under :data:`OVERLAP_INFORMATIVE` of their compute; on a GPU a blend that waited for its
  layers shows the wait in its host-side compute time, so only the least of those is kept:
  in the H100 placement run, 32 blends in a row from disk and throttled tiers priced a blend's
  fixed cost at 0.10-0.15 s, a 4K blend's whole time being 0.06 s), with
  ``W = rows * (k_lin + keys / 2)``: ``rows`` computed per layer (mean over layers), each
  through the layer's linear maps (``k_lin`` = their FLOPs per row over attention's FLOPs per
  key: ``hidden + kv_dim + 1.5 * intermediate`` for a Llama-style layer) and attending to half
  the prompt's ``keys`` on average (causal). ``r`` is the least seconds per unit of work
  among the last :data:`PREFILL_WINDOW` prefills (of :data:`LONG_PREFILL_TOKENS` or more when
  there are such) and ``floor`` the least seconds of any recent prefill: on a GPU a
  short prefill is bound by its launches (~20 ms on an H100 up to ~1K tokens), so a line fitted
  through prefills of 128-2,048 tokens had a slope ~0.6x the real one and priced an 8K-token
  prefill at 0.15 s against 0.23 s measured; the least per-work cost is the prefill off that
  floor. A worker's own prefills are passage-sized, so it measures a few longer ones once at
  start-up (:func:`cluster.vllm.cost_samples.calibration_samples`). A row a partial plan adds costs the same ``r``: on
  the H100 a blend that recomputed half its chunks cost 1.05-1.2x the prefill's per-row time
  per row it added (a least ratio of a blend's seconds to the prefill rate, used before,
  counted a blend's fixed cost again in every added row, 3-8x, and no split was ever chosen).
  A least-squares line over the blends (exponential forgetting, :data:`FORGET`) prices compute
  until a prefill was measured. Samples: every blend (its ``compute_s``, load waits
  excluded, and its rows per layer) and every prefill the worker runs (canonical KV of stored
  chunks, fallbacks). Until the first sample :attr:`compute_known` is False and the planner
  loads every hit, as before this existed.
* **Transfer**, per tier that answered a lookup (``gpu``, ``host``, ``disk``, ``redis``,
  ``s3``): ``seconds = latency + bytes / bandwidth``, tiers read one after another (one pipe:
  the shard, the agent, shared memory and staging are shared). Priors: :data:`PRIORS` (a
  conservative guess per tier, replaced by what is measured). A sample is a blend's bytes per
  tier and an interval: the transfer took at least the seconds the engine waited for layers
  and at most the seconds from asking for its layers to the last layer's arrival. Not one
  number: sources read when the engine asks (a machine-local client reads inside the wait) or
  stage a bounded ring of layers ahead, so the last layer's arrival follows the engine's
  compute, and a pipe that kept up looks as slow as the compute (in the engine lane on CPU,
  host reads of a few ms were priced at the compute's seconds and chunks recomputed). The
  interval is shared out among the tiers in proportion to what the estimates predicted for
  each, and a tier's seconds per byte moves :data:`ALPHA` of the way toward its share only
  when its prediction lies outside it; all the way when a blend read one tier only and its
  bytes came sooner than predicted (the last layer's arrival bounds that tier's time). Where
  the source measures its own busy time (:class:`tiers.staging.StagedSource`: seconds in its
  fills and slot waits, its waits for the engine left out; the last few layers' device copies
  are queued, not waited for, so it runs a little short), that time is the sample, a point:
  an interval cannot show a tier that got faster while its reads hide under compute (on the
  H100 a throttled tier back at 20 GB/s was not loaded again within 24 requests: one explored
  chunk's ~3 ms read sat inside an interval as long as the blend).
* **Overlap** (:attr:`CostEstimator.overlap`): how much of the shorter of a blend's compute and
  transfer hid under the longer (:func:`blend.cost.blend_seconds`). A sample is a blend that
  loaded chunks: its rows, keys, bytes per tier and wall time (compute plus load waits). With
  the estimates' own compute ``c`` and transfer ``t`` for it, a perfect pipeline takes
  ``max(c, t)`` and no overlap ``c + t``; the sample's overlap is where its wall time falls
  between the two, and the estimate moves :data:`ALPHA` of the way toward it. Only blends whose
  shorter part is at least :data:`OVERLAP_INFORMATIVE` of the longer count (with a transfer of
  a few ms under a second of compute, any overlap fits). Prior :data:`OVERLAP_PRIOR`: half.
  Why it is measured: on an H100 a blend reading half its chunks from disk while recomputing
  the rest took the sum of the two, not the longer (the placement run in ``docs/benchmarks.md``).
* **Exploration.** A tier whose chunks the planner keeps recomputing is no longer measured; after
  :data:`EXPLORE_AFTER` plans in a row that had hits there and loaded none, :meth:`explore`
  names it and the next plan loads one chunk of it (the planner's ``explore``).

Lives in the scheduler half's process, fed by the worker halves through vLLM's worker metadata
(:class:`cluster.vllm.cost_samples.CostSamples`, built by the worker each step, aggregated by vLLM, handed to the
scheduler's ``update_connector_output``). Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping

from blend.cost import apply_choice, choose
from blend.plan import BlendPlan
from cluster.vllm.cost_samples import BLEND, PREFILL, CostSamples

log = logging.getLogger("kvblend.connector")

#: tier -> (latency s, bandwidth bytes/s) before anything is measured
PRIORS: dict[str, tuple[float, float]] = {
    "gpu": (0.0, 1e12), "host": (0.001, 10e9), "disk": (0.005, 1.5e9),
    "redis": (0.002, 0.5e9), "s3": (0.05, 0.1e9),
}
#: prior of a tier not in PRIORS
DEFAULT_PRIOR = (0.01, 1e9)
#: weight of the newest transfer (and overlap) sample in an estimate
ALPHA = 0.3
#: the overlap of compute and transfer before a blend measured it (0: one after the other, 1: a
#: perfect layer pipeline)
OVERLAP_PRIOR = 0.5
#: a blend measures the overlap only if its shorter part (compute or transfer) is at least this
#: share of the longer
OVERLAP_INFORMATIVE = 0.2
#: forgetting factor of the compute fit (per sample)
FORGET = 0.9
#: recent blends whose least overhead over the prefill rate is a blend's fixed cost
BLEND_WINDOW = 32
#: recent prefills whose least seconds per unit of work is the row rate (of the long ones, when
#: there are any: LONG_PREFILL_TOKENS)
PREFILL_WINDOW = 32
#: prefills of at least this many tokens are kept in a window of their own: a worker's
#: passage-sized prefills (every missed passage) would otherwise push its start-up calibration
#: out after 32 of them, and on a GPU those sit on the launch-bound floor (a 512-token one priced
#: an 8K prefill at 0.37 s against 0.23 s on an H100)
LONG_PREFILL_TOKENS = 1024
#: plans in a row with hits in a tier and none loaded before that tier is explored
EXPLORE_AFTER = 8
#: tier names counted on /metrics as they are (any other is counted as "other")
TIERS = ("gpu", "host", "disk", "redis", "s3")


class _Fit:
    """``seconds = c0 + s * W`` by least squares over samples ``(W, seconds)`` with exponential
    forgetting (:data:`FORGET`); ``c0 >= 0`` (else the line through the origin)."""

    def __init__(self) -> None:
        self.sums = [0.0] * 5   # weighted n, W, S, W*W, W*S
        self.c0, self.s = 0.0, 0.0

    @property
    def known(self) -> bool:
        return self.s > 0.0

    def add(self, w: float, seconds: float) -> None:
        f = self.sums
        for i, v in enumerate((1.0, w, seconds, w * w, w * seconds)):
            f[i] = FORGET * f[i] + v
        n, sw, ss, sww, sws = f
        den = n * sww - sw * sw
        slope = (n * sws - sw * ss) / den if n > 1.5 and den > 1e-12 * n * sww else 0.0
        c0 = (ss - slope * sw) / n if slope > 0 else -1.0
        if c0 < 0:  # no negative overhead: the line through the origin
            c0, slope = 0.0, sws / sww
        self.c0, self.s = c0, slope

    def __call__(self, w: float) -> float:
        return self.c0 + self.s * w


def linear_keys(hidden: int, kv_dim: int, intermediate: int) -> float:
    """``k_lin``: a row's linear-map FLOPs per layer in units of one key's attention FLOPs
    (q/k/v, o and a gated MLP over ``4 * hidden`` FLOPs per key)."""
    return hidden + kv_dim + 1.5 * intermediate


class CostEstimator:
    """See the module docstring.

    Args:
        k_lin: :func:`linear_keys` of the served model.
        priors: tier -> ``(latency s, bytes/s)`` overriding :data:`PRIORS`.
        overlap: the overlap before one is measured (:data:`OVERLAP_PRIOR`).
    """

    def __init__(self, k_lin: float, priors: Mapping[str, tuple[float, float]] | None = None,
                 overlap: float = OVERLAP_PRIOR) -> None:
        self.k_lin = float(k_lin)
        self._overlap = min(1.0, max(0.0, float(overlap)))
        self._priors = {**PRIORS, **(priors or {})}
        self._tiers: dict[str, list[float]] = {}     # tier -> [latency s, seconds per byte]
        self._fits = {BLEND: _Fit(), PREFILL: _Fit()}
        self._blends: deque[tuple[float, float]] = deque(maxlen=BLEND_WINDOW)  # recent (W, seconds)
        self._prefills: deque[tuple[float, float]] = deque(maxlen=PREFILL_WINDOW)  # recent (W, seconds)
        self._long: deque[tuple[float, float]] = deque(maxlen=PREFILL_WINDOW)  # of LONG_PREFILL_TOKENS+
        self._unexplored: dict[str, int] = {}
        self._lock = threading.Lock()

    # -------------------------------------------------------------------- CostEstimates
    @property
    def compute_known(self) -> bool:
        """Whether a blend has been measured (its fixed cost is a blend's own)."""
        with self._lock:
            return self._fits[BLEND].known

    def work(self, rows: float, keys: int) -> float:
        return float(rows) * (self.k_lin + keys / 2.0)

    def compute_s(self, rows: float, keys: int) -> float:
        """A blend's compute: ``rows`` per layer over a ``keys``-token prompt at the row rate
        (:meth:`row_rate`) plus a blend's own fixed cost (:meth:`blend_overhead_s`); the blend
        fit alone until a prefill was measured."""
        with self._lock:
            return self._compute(rows, keys)

    def _compute(self, rows: float, keys: int) -> float:
        w = self.work(rows, keys)
        rate = self._rate()
        if rate <= 0:
            return self._fits[BLEND](w)
        return self._overhead() + rate * w

    def row_rate(self) -> float:
        """Seconds per unit of work (:meth:`work`) of a computed row, in a prefill or a blend:
        the least ``seconds / W`` among the last :data:`PREFILL_WINDOW` prefills of at least
        :data:`LONG_PREFILL_TOKENS` tokens, or of any length while there is none (0: none yet).
        A row a partial plan adds over loading every hit is priced at it too."""
        with self._lock:
            return self._rate()

    def _rate(self) -> float:
        return min((sec / w for w, sec in self._long or self._prefills), default=0.0)

    def _overhead(self) -> float:
        """The least ``seconds - r * W`` over the recent blends (>= 0): a blend's fixed
        cost (launches, the probe, selection). The least, not the mean: a blend that waited for
        its layers on the device (the host sees the wait in its compute time) only adds."""
        rate = self._rate()
        return max(0.0, min((sec - rate * w for w, sec in self._blends), default=0.0))

    def blend_overhead_s(self) -> float:
        with self._lock:
            return self._overhead()

    def prefill_s(self, tokens: int) -> float:
        """Full prefill of ``tokens``: every row at the row rate, at least the least prefill
        seen (the launch-bound floor); the blend fit over every row until a prefill was
        measured (a blend's fixed cost on top: loading is favoured, as before)."""
        with self._lock:
            w = self.work(tokens, tokens)
            rate = self._rate()
            if rate <= 0:
                return self._fits[BLEND](w)
            return max(min(sec for _, sec in self._prefills), rate * w)

    def transfer_s(self, bytes_by_tier: Mapping[str, int]) -> float:
        with self._lock:
            return self._transfer(bytes_by_tier)

    def _transfer(self, bytes_by_tier: Mapping[str, int]) -> float:
        return sum(self._predict(t, n) for t, n in bytes_by_tier.items() if n > 0)

    @property
    def overlap(self) -> float:
        with self._lock:
            return self._overlap

    def _predict(self, tier: str, nbytes: int) -> float:
        lat, spb = self._tier(tier)
        return lat + nbytes * spb

    def _tier(self, tier: str) -> list[float]:
        got = self._tiers.get(tier)
        if got is None:
            lat, bw = self._priors.get(tier, DEFAULT_PRIOR)
            got = self._tiers[tier] = [lat, 1.0 / bw]
        return got

    # -------------------------------------------------------------------- updates
    def add(self, samples: CostSamples) -> None:
        """Fold a worker step's measurements in (bad samples — non-positive or non-finite — are skipped)."""
        for rows, keys, seconds, kind in samples.compute:
            self.add_compute(rows, keys, seconds, kind)
        for by_tier, seconds, waited, *busy in samples.transfer:
            self.add_transfer(by_tier, seconds, waited, busy[0] if busy else None)
        for by_tier, rows, keys, compute, wall in samples.blends:
            self.add_blend(by_tier, rows, keys, compute, wall)

    def add_compute(self, rows: float, keys: int, seconds: float, kind: str = BLEND,
                    fixed_cost: bool = True) -> None:
        """One blend's or prefill's compute; a blend's also counts toward a blend's fixed cost
        unless ``fixed_cost`` is False (its loads may have kept the device waiting)."""
        w = self.work(rows, keys)
        if not (w > 0 and 0 < seconds < float("inf")) or kind not in self._fits:
            return
        with self._lock:
            self._fits[kind].add(w, seconds)
            if kind == BLEND and fixed_cost:
                self._blends.append((w, seconds))
            elif kind == PREFILL:
                self._prefills.append((w, seconds))
                if keys >= LONG_PREFILL_TOKENS:
                    self._long.append((w, seconds))

    def add_transfer(self, bytes_by_tier: Mapping[str, int], seconds: float, waited: float | None = None,
                     busy: float | None = None) -> None:
        """One blend's transfer: it took between ``waited`` (default ``seconds``: a point) and
        ``seconds``, or ``busy`` seconds where the source measured its own time (a point, at
        most ``seconds``; module docstring)."""
        lower = seconds if waited is None else waited
        if not (0 < seconds < float("inf") and 0 <= lower <= seconds):
            return
        if busy is not None and 0 < busy < float("inf"):
            lower = seconds = min(busy, seconds)
        with self._lock:
            parts = {t: n for t, n in bytes_by_tier.items() if n > 0}
            predicted = {t: self._predict(t, n) for t, n in parts.items()}
            total = sum(predicted.values())
            if total <= 0:
                return
            for t, n in parts.items():
                share = predicted[t] / total
                low, high = lower * share, seconds * share
                if low <= predicted[t] <= high:
                    continue  # consistent with what was measured
                est = self._tier(t)
                per_byte = max(0.0, (low if predicted[t] < low else high) - est[0]) / n
                # One tier read faster than predicted: its bytes arrived within ``high``, a
                # certain bound, so the estimate goes there at once (on the H100 a 10 GB/s prior
                # took four loading blends to reach the ~60 GB/s of chunks already on the GPU, and
                # four requests went to full prefill at 3.4x the time). Slower than predicted, or
                # a share of a multi-tier interval: ALPHA of the way (one late wait is noise).
                step = 1.0 if len(parts) == 1 and predicted[t] > high else ALPHA
                est[1] += step * (per_byte - est[1])

    def add_blend(self, bytes_by_tier: Mapping[str, int], rows: float, keys: int, compute: float,
                  wall: float) -> None:
        """One blend that loaded ``bytes_by_tier`` and computed ``rows`` per layer over ``keys``
        tokens, ``compute`` seconds of its ``wall`` seconds outside load waits: its compute
        sample (toward a blend's fixed cost only if its predicted transfer is under
        :data:`OVERLAP_INFORMATIVE` of that compute: on a GPU the host's compute time also holds
        the device's waits for late layers), then the overlap (module docstring)."""
        with self._lock:
            t = self._transfer(bytes_by_tier)
        self.add_compute(rows, keys, compute, BLEND, fixed_cost=t <= OVERLAP_INFORMATIVE * compute)
        if not (0 < wall < float("inf") and rows > 0 and keys > 0):
            return
        with self._lock:
            c = self._compute(rows, keys)
            low, high = min(c, t), max(c, t)
            if not (low > 0 and low >= OVERLAP_INFORMATIVE * high):
                return
            seen = min(1.0, max(0.0, (high + low - wall) / low))
            self._overlap += ALPHA * (seen - self._overlap)

    # -------------------------------------------------------------------- exploration
    def note_plan(self, loaded: Mapping[str, int], recomputed: Mapping[str, int]) -> None:
        """After a plan: chunks loaded and recomputed per tier (resets or advances exploration)."""
        with self._lock:
            for t in set(loaded) | set(recomputed):
                if loaded.get(t, 0):
                    self._unexplored.pop(t, None)
                elif recomputed.get(t, 0):
                    self._unexplored[t] = self._unexplored.get(t, 0) + 1

    def explore(self) -> set[str]:
        """Tiers the next plan should load one chunk of (see the module docstring)."""
        with self._lock:
            return {t for t, n in self._unexplored.items() if n >= EXPLORE_AFTER}

    def snapshot(self) -> dict:
        """The current estimates (for the event log): compute fit and per tier latency / GB/s."""
        with self._lock:
            return {"blend_overhead_s": self._overhead(), "row_s_per_work": self._rate(),
                    "prefill_floor_s": min((sec for _, sec in self._prefills), default=0.0),
                    "overlap": self._overlap, **{f"{k}_c0_s": f.c0 for k, f in self._fits.items()},
                    **{f"{k}_s_per_work": f.s for k, f in self._fits.items()},
                    "tiers": {t: {"latency_s": lat, "gbps": (1.0 / spb / 1e9) if spb > 0 else float("inf")}
                              for t, (lat, spb) in sorted(self._tiers.items())}}


def plan_with_costs(plan: BlendPlan, estimator: CostEstimator, *, kv_bytes_per_token: int,
                    num_layers: int) -> tuple[BlendPlan, dict | None, dict[str, int]]:
    """The scheduler half's use of the estimates: ``plan`` with :func:`blend.cost.choose`'s
    choice applied (the tiers :meth:`CostEstimator.explore` names explored), the ``cost``
    record of the lookup event (None when nothing was chosen: compute not measured yet, or no
    hit) and the counter deltas (``cost_loaded_chunks:<tier>``, ``cost_recomputed_chunks:<tier>``).
    Never changes a chunk's key, or whether a missed chunk is stored."""
    choice = choose(plan, estimator, kv_bytes_per_token=kv_bytes_per_token, num_layers=num_layers,
                    explore=estimator.explore())
    if choice is None:
        return plan, None, {}
    loaded: dict[str, int] = {}
    recomputed: dict[str, int] = {}
    for _, tier, _, what in choice.tiers:
        bucket = loaded if what == "load" else recomputed
        bucket[tier] = bucket.get(tier, 0) + 1
    estimator.note_plan(loaded, recomputed)
    counts: dict[str, int] = {}
    for name, per_tier in (("cost_loaded_chunks", loaded), ("cost_recomputed_chunks", recomputed)):
        for tier, n in per_tier.items():
            key = f"{name}:{tier if tier in TIERS else 'other'}"
            counts[key] = counts.get(key, 0) + n
    record = {"expected_s": choice.blend_s, "always_load_s": choice.always_load_s, "full_s": choice.full_s,
              "full_prefill": choice.full_prefill,
              "chunks": [[tier, tokens, what] for _, tier, tokens, what in choice.tiers],
              "estimates": estimator.snapshot()}
    return apply_choice(plan, choice), record, counts


def cost_model_for(vllm_config) -> dict:
    """The scheduler half's cost arguments from the served model's shape (a vLLM ``VllmConfig``):
    ``{"costs": CostEstimator, "kv_bytes_per_token": K and V of one token in every layer in the
    model dtype, "num_layers": ...}``; ``{}`` (every hit loaded) when the shape cannot be read."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    try:
        hf = mc.hf_text_config
        layers, kv_heads, head = mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size()
        k_lin = linear_keys(int(hf.hidden_size), kv_heads * head, int(getattr(hf, "intermediate_size", 0) or 0))
        per_token = 2 * layers * kv_heads * head * mc.dtype.itemsize
    except (AttributeError, TypeError, ValueError) as e:
        log.warning("kvblend: model shape not readable (%s); every hit chunk is loaded", e)
        return {}
    return {"costs": CostEstimator(k_lin), "kv_bytes_per_token": per_token, "num_layers": layers}
