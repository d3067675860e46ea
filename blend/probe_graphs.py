"""The query probe's layers as CUDA graphs, one per layer and shape bucket (issue 33).

The probe (:func:`blend.query_selection.probe_query_mass`) runs ~65 rows (prefix, separators,
query) through layers ``0 .. max(probe_layers)`` over the cached KV: on an H100 at 8K tokens
of a 7B-shaped model that was 21 ms of a 87 ms blend for ~3 ms of GPU work, launch- and
Python-bound (``docs/benchmarks.md``, "No host wait inside a blend"). Here each probe layer's
work is captured once per shape bucket and replayed with one call:

    per request (eager)   embed the rows, fill the bucket's static inputs (positions, which
                          rows are the query's, where fresh K/V go)
    per layer  (eager)    the layer's cached KV ([2, T', H, D], hit rows placed by the engine)
                          is copied into the bucket's staging buffer, its padded tail zeroed
               (replay)   qkv -> fresh K/V into staging -> the query rows' attention mass
                          (probe layers) -> attention over staging -> finish_layer
               (eager)    the fresh K/V rows go back into the engine's layer buffer

A bucket is ``(shape_bucket(A), shape_bucket(T'), probe_layers)``: rows and keys padded as
FlexAttention already pads them (:func:`blend.flex_rows.shape_bucket`). Pad rows repeat the last
real row (finite everywhere), write their K/V to a trash row past the keys, and carry weight 0
in the mass; pad keys are zeros no query sees. Every real row's result is the eager probe's up
to the rounding of GEMMs over more rows (a CUDA library may pick another kernel for 128 rows
than for 65). A bucket serves one request's probe at a time (:meth:`ProbeGraphs.release`); a
second request probing meanwhile (a vLLM worker interleaves blends) runs eagerly.

Buckets are captured by :meth:`ProbeGraphs.prepare` (at start-up: the vLLM worker, the
benchmark before timing; the time and the memory are reported), never inside a request: a
request whose bucket is not ready runs the eager probe. A capture that fails turns graphs off
for good, with one warning. Off CUDA (tests) the same step functions run without capture over
the same static buffers, so the bucket's bookkeeping is checked against the eager probe on CPU.

Axis letters as in :mod:`blend.engine`; ``Ap`` and ``Tp`` are the padded rows and keys.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from blend import ops
from blend.query_selection import query_attention_mass

log = logging.getLogger(__name__)

#: Row buckets :meth:`ProbeGraphs.prepare_all` captures (a probe computes the prefix, one
#: separator per chunk and the query: ~65 rows at 8K tokens of 512-token chunks): the rows
#: FlexAttention compiles for the probe at start-up (:func:`blend.flex_rows.prepare_flex`).
ROW_BUCKETS = ops.PROBE_ROWS


@dataclass
class _Bucket:
    """Static inputs and outputs of one (rows, keys, probe layers) bucket, and its graphs."""

    rows: int                 # Ap
    keys: int                 # Tp
    probe_layers: tuple[int, ...]
    hidden: torch.Tensor      # [Ap, E] the rows' hidden state entering the next layer
    residual: torch.Tensor    # [Ap, E]
    rope_pos: torch.Tensor    # [Ap] int64 prompt positions (RoPE)
    att_pos: torch.Tensor     # [Ap] int64 positions among the probe's keys (causality)
    write_idx: torch.Tensor   # [Ap] int64 staging row of each row's fresh K/V (pads: the trash row)
    weight: torch.Tensor      # [Ap] float32 1 for the query's rows, else 0
    fresh_k: torch.Tensor     # [Ap, H, D] this layer's fresh K (copied out of the replay)
    fresh_v: torch.Tensor     # [Ap, H, D]
    mass: torch.Tensor        # [Tp] float32 summed over the probe layers
    graphs: list = field(default_factory=list)  # per layer: a CUDAGraph (None: run the step)
    num_rows: int = 0         # real rows of the current request (A)
    num_keys: int = 0         # real keys of the current request (T')
    busy: bool = False        # a request's probe holds the buffers (begin .. release)


class ProbeGraphs:
    """Per-layer CUDA graphs of the query probe for one model (see the module docstring).

    Args:
        model: the :class:`~blend.protocols.BlendModel` (its per-layer calls must be capturable:
            :class:`blend.adapters.fused_layers.FusedLlamaLayers` is).
        scale: the attention's softmax scale (the engine's).
        max_tokens: the longest prompt a bucket is prepared for; the staging buffer
            ``[2, shape_bucket(max_tokens) + 1, H, D]`` is allocated once at the first
            :meth:`prepare` (128 MiB at 32K tokens of 8 KV heads of 128 dims in bf16).
        capture: record CUDA graphs (default: when the model is on CUDA); False runs the step
            functions directly (the CPU tests' mode: same buffers, no graph).

    Not thread-safe: one engine thread drives it, as it drives the model.
    """

    def __init__(self, model, scale: float, max_tokens: int, *, capture: bool | None = None) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens} must be > 0")
        self.model, self.scale = model, float(scale)
        self.max_keys = ops.shape_bucket(max_tokens)
        self.capture = model.device.type == "cuda" if capture is None else bool(capture)
        self.broken: str | None = None
        self.prepare_s = 0.0
        self.layer_runs = 0
        self._buckets: dict[tuple, _Bucket] = {}
        self._staging: torch.Tensor | None = None  # [2, max_keys + 1, H, D]
        self._pool = None
        self._side = None  # the CUDA stream every bucket's warm-up runs on (created at the first capture)

    # ------------------------------------------------------------------ buckets
    @staticmethod
    def key(num_rows: int, num_keys: int, probe_layers: tuple[int, ...]) -> tuple:
        return ops.shape_bucket(num_rows), ops.shape_bucket(num_keys), tuple(probe_layers)

    def ready(self, num_rows: int, num_keys: int, probe_layers: tuple[int, ...]) -> _Bucket | None:
        """The prepared bucket for a probe of ``num_rows`` rows over ``num_keys`` keys, or None
        (not prepared, too long, graphs broken, or held by another request's probe: a vLLM
        worker interleaves blends layer by layer): the caller then runs the eager probe."""
        if self.broken is not None or num_rows <= 0 or num_keys <= 0:
            return None
        bucket = self._buckets.get(self.key(num_rows, num_keys, probe_layers))
        return None if bucket is None or bucket.busy else bucket

    def stats(self) -> dict:
        """Buckets prepared, seconds spent preparing, layers run from a bucket, staging bytes, why off."""
        staging = 0 if self._staging is None else self._staging.numel() * self._staging.element_size()
        return {"buckets": sorted([k[0], k[1]] for k in self._buckets), "prepare_s": self.prepare_s,
                "layer_runs": self.layer_runs, "staging_bytes": staging, "broken": self.broken}

    def prepare_all(self, probe_layers: tuple[int, ...], row_buckets=ROW_BUCKETS) -> float:
        """:meth:`prepare` every key bucket up to ``max_tokens``' for every row bucket in
        ``row_buckets`` (the vLLM worker at start-up); returns the seconds it took."""
        t0 = time.perf_counter()
        keys = ops.FLEX_BLOCK
        while True:
            for rows in row_buckets:
                if rows <= keys and not self.prepare(rows, keys, probe_layers):
                    return time.perf_counter() - t0
            if keys >= self.max_keys:
                return time.perf_counter() - t0
            keys = ops.shape_bucket(keys + 1)

    def prepare_plan(self, plan) -> bool:
        """:meth:`prepare` the bucket a :class:`~blend.plan.BlendPlan`'s probe will ask for:
        rows and keys as :func:`blend.query_selection.select_rows` counts them (the prompt up
        to the query's end; a missed chunk's rows are neither), its probe layers."""
        from blend.plan import CHUNK
        from blend.query_selection import probe_layers_for

        end = plan.query_rows[1] if plan.query_rows is not None else plan.blend_end

        def rows_of(hit: bool) -> int:
            return sum(max(0, min(s.end, plan.blend_end) - s.start) for s in plan.segments
                       if s.kind == CHUNK and s.hit == hit)

        reused, missed = rows_of(True), rows_of(False)
        layers = probe_layers_for(plan.probe_layers, self.model.spec.num_layers)
        return self.prepare(end - reused - missed, end - missed, layers)

    def prepare(self, num_rows: int, num_keys: int, probe_layers: tuple[int, ...]) -> bool:
        """Capture the graphs of the bucket holding ``num_rows`` rows over ``num_keys`` keys
        (once; later calls return at once). Runs every layer's step eagerly first (compiles,
        cuBLAS workspaces), then records it. False when it could not (graphs are then off
        for good, logged once) or the keys exceed ``max_tokens``' bucket."""
        key = self.key(num_rows, num_keys, probe_layers)
        if self.broken is not None or key[1] > self.max_keys:
            return False
        if key in self._buckets:
            return True
        t0 = time.perf_counter()
        try:
            bucket = self._new_bucket(*key)
            self._dummy_request(bucket)
            last = bucket.probe_layers[-1]
            if self.capture:
                self._capture(bucket, last)
            else:
                bucket.graphs = [None] * (last + 1)
        except Exception as e:  # noqa: BLE001 - a capture that fails: the eager probe, logged once
            self.broken = f"{type(e).__name__}: {e}"
            self._buckets.clear()  # their graphs and buffers are freed; staging stays (small)
            log.warning("CUDA graphs of the query probe are off (%s); the probe runs eagerly", self.broken)
            return False
        finally:
            self.prepare_s += time.perf_counter() - t0
        self._buckets[key] = bucket
        return True

    def _new_bucket(self, rows: int, keys: int, probe_layers: tuple[int, ...]) -> _Bucket:
        spec, dev, dt = self.model.spec, self.model.device, self.model.dtype
        if self._staging is None:
            self._staging = torch.zeros((2, self.max_keys + 1, spec.num_kv_heads, spec.head_dim), dtype=dt,
                                        device=dev)
        hidden = self.model.embed(torch.zeros(rows, dtype=torch.long, device=dev))
        kv_shape = (rows, spec.num_kv_heads, spec.head_dim)
        return _Bucket(rows, keys, probe_layers, hidden=hidden.clone(), residual=torch.zeros_like(hidden),
                       rope_pos=torch.zeros(rows, dtype=torch.int64, device=dev),
                       att_pos=torch.zeros(rows, dtype=torch.int64, device=dev),
                       write_idx=torch.full((rows,), keys, dtype=torch.int64, device=dev),
                       weight=torch.zeros(rows, dtype=torch.float32, device=dev),
                       fresh_k=torch.zeros(kv_shape, dtype=dt, device=dev),
                       fresh_v=torch.zeros(kv_shape, dtype=dt, device=dev),
                       mass=torch.zeros(keys, dtype=torch.float32, device=dev))

    def _dummy_request(self, b: _Bucket) -> None:
        """Valid inputs to record with: every row real, at positions ``0..Ap-1``."""
        n = min(b.rows, b.keys)
        pos = torch.arange(b.rows, device=b.rope_pos.device).clamp_max(n - 1)
        b.rope_pos.copy_(pos)
        b.att_pos.copy_(pos)
        b.write_idx.copy_(pos)
        b.weight.fill_(1.0)
        b.num_rows, b.num_keys = n, b.keys

    def _capture(self, b: _Bucket, last: int) -> None:
        graphs = []
        if self._side is None:  # one warm-up stream for every bucket: cuBLAS keeps a workspace per stream
            self._side = torch.cuda.Stream(self.model.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.no_grad(), torch.cuda.stream(side):
            for layer_idx in range(last + 1):
                self._step(b, layer_idx)  # warm-up: compiles, workspaces, cached tables
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        torch.cuda.synchronize(self.model.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for layer_idx in range(last + 1):
            g = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                self._step(b, layer_idx)
            graphs.append(g)
        torch.cuda.synchronize(self.model.device)
        b.graphs = graphs

    # ------------------------------------------------------------------ a request
    def begin(self, b: _Bucket, hidden: torch.Tensor, rope_pos: torch.Tensor, att_pos: torch.Tensor,
              num_query_rows: int, num_keys: int) -> None:
        """Load one request into the bucket's static inputs.

        Args:
            hidden: ``[A, E]`` the rows' embeddings. rope_pos: ``[A]`` int64 their prompt
                positions. att_pos: ``[A]`` int64 their indices among the probe's ``num_keys``
                keys, ascending (the query rows last).
            num_query_rows: the last rows that are the query's (their mass is summed).
        """
        a = hidden.shape[0]
        if not 0 < a <= b.rows or num_keys > b.keys or num_query_rows > a:
            raise ValueError(f"{a} rows over {num_keys} keys do not fit bucket ({b.rows}, {b.keys})")
        if b.busy:
            raise RuntimeError("the bucket is held by another request's probe")
        b.num_rows, b.num_keys = a, num_keys
        b.hidden[:a].copy_(hidden)
        b.hidden[a:].copy_(hidden[-1:].expand(b.rows - a, -1))
        b.rope_pos[:a].copy_(rope_pos)
        b.rope_pos[a:].copy_(rope_pos[-1:].expand(b.rows - a))
        b.att_pos.copy_(ops.pad_rows(att_pos, b.rows))
        b.write_idx[:a].copy_(att_pos)
        b.write_idx[a:].fill_(b.keys)  # the trash row, past every key
        b.weight.zero_()
        b.weight[a - num_query_rows:a] = 1.0
        b.mass.zero_()
        b.busy = True  # last: a copy that raised leaves the bucket free

    def layer(self, b: _Bucket, layer_idx: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One probe layer: ``kv`` ``[2, T', H, D]`` (the probe's keys, hit rows placed) is
        copied into staging, the layer replays; returns the fresh ``[A, H, D]`` K and V of the
        request's rows (views of static buffers: use them before the next call)."""
        staging = self._staging
        n = b.num_keys
        staging[:, :n].copy_(kv)
        if n < b.keys:  # every layer: staging is shared by the buckets of interleaved requests
            staging[:, n:b.keys].zero_()
        g = b.graphs[layer_idx]
        if g is None:
            self._step(b, layer_idx)
        else:
            g.replay()
        self.layer_runs += 1
        return b.fresh_k[:b.num_rows], b.fresh_v[:b.num_rows]

    def mass(self, b: _Bucket) -> torch.Tensor:
        """``[T']`` float32 the query rows' attention mass summed over the probe layers (a view
        of a static buffer: use it before :meth:`release`)."""
        return b.mass[:b.num_keys]

    @staticmethod
    def release(b: _Bucket) -> None:
        """The request's probe is done with the bucket (finished, failed or abandoned)."""
        b.busy = False

    def _step(self, b: _Bucket, layer_idx: int) -> None:
        """One layer's work over the static buffers (what a graph records)."""
        model, keys = self.model, b.keys
        kv = self._staging[:, :keys + 1]  # row ``keys``: the trash row of pad rows
        q, k, v, residual = model.qkv(layer_idx, b.hidden, None if layer_idx == 0 else b.residual, b.rope_pos)
        kv[0, b.write_idx] = k
        kv[1, b.write_idx] = v
        b.fresh_k.copy_(k)
        b.fresh_v.copy_(v)
        k_all, v_all = kv[0, :keys], kv[1, :keys]
        if layer_idx in b.probe_layers:
            b.mass.add_(query_attention_mass(q, b.att_pos, k_all, self.scale, v_all, row_weight=b.weight))
        if layer_idx < b.probe_layers[-1]:
            rows = ops.prepare_rows(b.att_pos, keys) if q.is_cuda else None
            attn_out = ops.causal_attention(q, k_all, v_all, b.att_pos, self.scale, rows)
            hidden, residual = model.finish_layer(layer_idx, attn_out, residual)
            b.hidden.copy_(hidden)
            b.residual.copy_(residual)
