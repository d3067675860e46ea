"""The harness of ``kvblend bench gpu`` (:mod:`cluster.bench.gpu`): model, tiers, plans, timing loops.

:class:`GpuBench` builds a random-weight Llama-shaped model on the device (wrapped by
:class:`blend.adapters.fused_llama.FusedLlamaAdapter`, whose layers are computed by
:class:`blend.adapters.fused_layers.FusedLlamaLayers` as in a vLLM worker, or by
:class:`blend.adapters.hf.HFModelAdapter`),
computes every chunk's canonical KV once into a gpu, a host and a disk tier, and times per
prompt length: full prefill, HF's forward, and a blend through each tier (lookup +
:meth:`blend.engine.BlendEngine.blend`), with the host-to-device copy rate and the disk's raw
read rate beside them. Prompts are ``| prefix (16) | sep | chunk 1 | sep | chunk 2 | ... | sep | query (32) |``.
Only the standard library is imported at module level.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time

from cluster.bench import gpu_ceilings as ceilings
from cluster.bench import gpu_graphs

log = logging.getLogger(__name__)

MODEL_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=65536,
                rope_theta=500000.0)
#: tokens per block of the paged cache the worker's per-layer callback writes (vLLM's default)
PAGE_BLOCK_TOKENS = 16
MODEL_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rope_theta=10000.0)
NAMESPACE = "6e6368676275667a"
PREFIX_TOKENS = 16
QUERY_TOKENS = 32


def _num_chunks(length: int, chunk_tokens: int) -> int:
    """Chunks (each after a 1-token separator) that bring the prompt closest to ``length``."""
    return max(1, round((length - PREFIX_TOKENS - QUERY_TOKENS - 1) / (chunk_tokens + 1)))


class GpuBench:
    """The model, the tiers and the timing loops of one run (``args``: :mod:`cluster.bench.gpu`'s flags)."""

    def __init__(self, args, device, lengths: list[int]) -> None:
        import torch
        import transformers

        from blend import engine as engine_module
        from blend import ops
        from blend.adapters.hf import HFModelAdapter
        from blend.engine import BlendEngine

        self.torch, self.args, self.device = torch, args, device
        self.engine_module, self.ops = engine_module, ops
        from blend import attention

        self.reference_attention = attention.blocked_row_attention  # what the engine used before issue 9
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        shape = MODEL_TINY if args.tiny else MODEL_7B
        dtype = torch.bfloat16 if device.type == "cuda" or not args.tiny else torch.float32
        config = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
        config._attn_implementation = "sdpa"
        t0 = time.perf_counter()
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = transformers.LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(default)
        log.info("model built on %s in %.1f s", device, time.perf_counter() - t0)
        self.hf_model = model

        self.adapter = HFModelAdapter(model, model_id="bench-llama")
        self.spec = self.adapter.spec
        self.model_check = None
        if args.model_impl == "fast":
            use_compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
            from blend.adapters.fused_llama import FusedLlamaAdapter

            fast = FusedLlamaAdapter(model, model_id=self.adapter.spec.model_id, compile=use_compile)
            self.warm_up_s = fast.warm_up()
            self.model_check = _check_model(fast, model, torch, device)
            self.adapter = fast
        self.model_desc = {k: shape[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                 "num_key_value_heads", "intermediate_size", "vocab_size")}
        self.model_desc["dtype"] = str(dtype).removeprefix("torch.")
        self.model_desc["impl"] = (
            "blend.adapters.fused_llama.FusedLlamaAdapter (fused qkv / gate_up weights of the same "
            f"LlamaForCausalLM, compile={getattr(self.adapter, 'compiled', False)})"
            if args.model_impl == "fast" else "transformers.LlamaForCausalLM + blend.adapters.hf.HFModelAdapter")
        self.model_desc["compute_class"] = compute_class(self.adapter)
        if args.model_impl == "fast":
            self.model_desc["warm_up_s"] = self.warm_up_s
        self.model_desc["check_vs_hf_forward"] = self.model_check
        self.BlendEngine = BlendEngine
        self.ratios = list(args.ratios)
        from blend.config import BlendConfig

        self.selections = list(args.selection)
        self.sink_tokens = BlendConfig().sink_tokens
        self._set_attention(args.attention)
        self._build_chunks(max(lengths))
        # FlexAttention's shapes compiled now, as a vLLM worker compiles them at start-up with
        # the product's default blend.flex_warm_tokens (here only up to the longest prompt timed)
        scale = BlendEngine(self.adapter).scale
        warm = min(BlendConfig().flex_warm_tokens, max(lengths) + 512)
        self.flex_warm = ops.prepare_flex(warm, self.spec.num_heads, self.spec.num_kv_heads,
                                          self.spec.head_dim, self.adapter.dtype, device, scale)
        self.model_desc["flex_warm"] = self.flex_warm
        # the query probe's CUDA graphs (--probe-graphs), every bucket up to the longest prompt
        # captured now by the vLLM worker's own start-up function
        if getattr(args, "probe_graphs", None) is None:  # as a vLLM worker: on CUDA when configured
            args.probe_graphs = "on" if device.type == "cuda" and BlendConfig().probe_graph_tokens > 0 else "off"
        self._paged = None  # [L] paged KV caches the worker's per-layer callback writes (_layer_writes)
        self.model_desc["layer_callback"] = ("cluster.vllm.paged.ClaimedLayerWrites over blend.kernels.paged."
                                             "scatter_paged (flash_attn layout), in every blend and full prefill")
        self.graphs, self.model_desc["probe_graphs"] = None, None
        if args.probe_graphs != "off":
            tokens = min(BlendConfig().probe_graph_tokens or 2**31, max(lengths) + 512)
            self.graphs, self.model_desc["probe_graphs"] = gpu_graphs.build_graphs(self, scale, tokens)

    # ------------------------------------------------------------------ setup
    def _set_attention(self, which: str) -> None:
        self.engine_module.causal_attention = self.ops.causal_attention if which == "ops" else self.reference_attention

    def _build_chunks(self, max_length: int) -> None:
        """Compute every chunk's canonical KV once and store it where each mode reads it:
        the product's machine-local clients over a host tier and over a disk tier, and the
        gpu tier of a worker source; each mode's source is built by
        :func:`cluster.vllm.worker_source.build_worker_source`, as the vLLM worker builds its own."""
        torch = self.torch
        from cluster.cache.local import LocalCacheClient
        from cluster.vllm.worker_source import build_worker_source
        from tiers.disk import DiskTier
        from tiers.host import HostTier
        from tiers.keys import segment_key

        n = self.args.chunk_tokens
        num_chunks = _num_chunks(max_length, n)
        gen = torch.Generator().manual_seed(1)
        vocab = self.spec.vocab_size
        self.chunk_ids = [torch.randint(8, vocab, (n,), generator=gen).tolist() for _ in range(num_chunks)]
        self.prefix_ids = torch.randint(8, vocab, (PREFIX_TOKENS,), generator=gen).tolist()
        self.query_ids = torch.randint(8, vocab, (QUERY_TOKENS,), generator=gen).tolist()
        self.sep_id = 3
        self.keys = [segment_key(NAMESPACE, ids) for ids in self.chunk_ids]
        kv_bytes = num_chunks * self.spec.num_layers * 2 * n * self.spec.num_kv_heads * self.spec.head_dim * 2
        capacity = 2 * kv_bytes + (1 << 30)
        self.disk_dir = self.args.disk_dir or tempfile.mkdtemp(prefix="kvblend-bench-gpu-")
        self.disk_tier = DiskTier(self.disk_dir, capacity, fsync=False)
        clients = {"host": LocalCacheClient(HostTier(capacity), device=self.device),
                   "disk": LocalCacheClient(self.disk_tier, device=self.device)}
        num_layers = self.spec.num_layers
        t0 = time.perf_counter()
        self.sources = {"gpu": build_worker_source(clients["host"], self.device, num_layers, gpu_bytes=capacity),
                        "host": build_worker_source(clients["host"], self.device, num_layers),
                        "disk": build_worker_source(clients["disk"], self.device, num_layers)}
        self.build_s = {"sources": time.perf_counter() - t0}
        engine = self.BlendEngine(self.adapter)
        t0 = time.perf_counter()
        for key, ids in zip(self.keys, self.chunk_ids, strict=False):
            kv = torch.stack(engine.prefill(ids, want_logits=False).kv)  # [L, 2, n, H, D]
            self.sources["gpu"].remember(key, kv)
            for client in clients.values():
                client.put(key, kv)
        self.build_s["chunks"] = time.perf_counter() - t0
        log.info("%d chunks cached in gpu/host/disk tiers in %.1f s (%.2f GB each tier)", num_chunks,
                 self.build_s["chunks"], kv_bytes / 1e9)
        self.page_cache = "not dropped (no disk run yet)"

    def _plan(self, length: int, ratio: float, selection: str = "", chunks=None):
        """The plan of a ``length``-token prompt (prefix, chunks, query); ``chunks``: its
        ``(keys, token ids)`` (default: the first chunks built here)."""
        from blend.plan import CHUNK, PREFIX, QUERY, SEPARATOR, BlendPlan, Segment

        n = self.args.chunk_tokens
        num_chunks = _num_chunks(length, n)
        keys, chunk_ids = chunks if chunks is not None else (self.keys, self.chunk_ids)
        ids = list(self.prefix_ids)
        segments = [Segment(PREFIX, 0, len(ids))]
        for key, chunk in zip(keys[:num_chunks], chunk_ids[:num_chunks], strict=False):
            segments.append(Segment(SEPARATOR, len(ids), len(ids) + 1))
            ids.append(self.sep_id)
            segments.append(Segment(CHUNK, len(ids), len(ids) + n, key=key, hit=True,
                                    stored_positions=tuple(range(n))))
            ids.extend(chunk)
        segments.append(Segment(SEPARATOR, len(ids), len(ids) + 1))
        ids.append(self.sep_id)
        segments.append(Segment(QUERY, len(ids), len(ids) + QUERY_TOKENS))
        ids.extend(self.query_ids)
        return BlendPlan(tuple(ids), tuple(segments), check_layers=(self.args.check_layer,),
                         recompute_ratios=(ratio,), blend_end=len(ids),
                         selection=selection or self.selections[0], sink_tokens=self.sink_tokens), num_chunks

    # ------------------------------------------------------------------ timing
    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _timed(self, fn, repeats: int, before=None) -> tuple[dict, object]:
        """One warm-up, then ``repeats`` synchronized runs (``before()`` ahead of each, not
        timed): ``{'median', 'min', 'max'}`` s."""
        fn()  # warm-up (compiles, sizes the pinned slots)
        times, last = [], None
        for _ in range(repeats):
            if before is not None:
                before()
            self._sync()
            t0 = time.perf_counter()
            last = fn()
            self._sync()
            times.append(time.perf_counter() - t0)
        return {"median": statistics.median(times), "min": min(times), "max": max(times)}, last

    def _layer_writes(self, tokens: int):
        """The vLLM worker's per-layer callback (:class:`cluster.vllm.paged.ClaimedLayerWrites`:
        rows ``0..tokens-1`` checked finite on the device and written into a paged cache by
        slot) over a paged cache of this bench's own: FlashAttention's ``[2, B, 16, H, D]``
        layout per layer, slots ``0..tokens-1``, written by
        :func:`blend.kernels.paged.scatter_paged` (a vLLM worker writes through its attention
        backend's cache update instead: vLLM does not install on the GPU machine)."""
        torch = self.torch
        from blend.kernels.paged import scatter_paged
        from cluster.vllm.paged import ClaimedLayerWrites

        blocks, spec = -(-tokens // PAGE_BLOCK_TOKENS), self.spec
        if self._paged is None or self._paged[0].shape[1] < blocks:
            self._paged = None  # dropped first (earlier writers' closures may still hold them)
            self._paged = [torch.zeros((2, blocks, PAGE_BLOCK_TOKENS, spec.num_kv_heads, spec.head_dim),
                                       dtype=self.adapter.dtype, device=self.device)
                           for _ in range(spec.num_layers)]
        caches = self._paged

        def write(layer_idx: int, kv, slots) -> None:
            scatter_paged(caches[layer_idx], "flash_attn", kv, slots, check_range=False)

        return ClaimedLayerWrites(0, tokens, torch.arange(tokens, device=self.device), write)

    def worker_engine(self, source=None, *, graphs: bool | None = None, **kwargs):
        """A :class:`blend.engine.BlendEngine` over ``source`` as the vLLM worker builds one:
        with the query probe's CUDA graphs when this run has them (``graphs`` False: without;
        None: as ``--probe-graphs``), ``kwargs`` (``load_timeout_s``) passed on. Every GPU
        bench (tiers, ``--placement``, ``--client``) builds its engines here."""
        if graphs is None:
            graphs = getattr(self.args, "probe_graphs", "off") == "on"
        return self.BlendEngine(self.adapter, source, probe_graphs=self.graphs if graphs else None, **kwargs)

    def run_blend(self, engine, plan):
        """``engine.blend(plan)`` to first-token logits as the worker runs it: every layer's
        claimed rows through the worker's per-layer callback (:meth:`_layer_writes`), then its
        one host read of whether they were finite.

        Raises:
            RuntimeError: a non-finite row (the worker would recompute the request)."""
        writes = self._layer_writes(plan.blend_end)
        result = engine.blend(plan, want_logits=True, on_layer=writes)
        if not writes.all_finite():
            raise RuntimeError("non-finite KV in a claimed layer")
        return result

    def run_prefill(self, engine, ids):
        """Full prefill of ``ids`` to first-token logits, each layer written into the paged
        cache as vLLM's own prefill writes its cache (:meth:`_layer_writes`)."""
        writes = self._layer_writes(len(ids))
        result = engine.prefill(list(ids), want_logits=True, on_layer=writes)
        if not writes.all_finite():  # vLLM reads nothing back; a bench that timed NaNs is wrong
            raise RuntimeError("non-finite KV in full prefill")
        return result

    def _blend_fn(self, plan, tier: str, num_chunks: int, graphs: bool | None = None):
        """One request as the worker serves it: lookup through the source, then the blend
        (every cached layer asked for at its start), to first-token logits; ``graphs``: with
        the probe's CUDA graphs (default: ``--probe-graphs on``)."""
        source = self.sources[tier]
        engine = self.worker_engine(source, graphs=graphs)
        keys = self.keys[:num_chunks]
        disk_files = [self.disk_tier._file(k) for k in keys]  # noqa: SLF001 - bench only

        def fn():
            if tier == "disk":
                self._sync()
                self.page_cache = ceilings.drop_page_cache(disk_files, self.args.page_cache)
            metas = source.lookup(keys)
            if any(m is None for m in metas):
                raise RuntimeError(f"{tier} tier lost chunks")
            result = self.run_blend(engine, plan)
            if result.counters.full_prefill_reason is not None:
                raise RuntimeError(f"blend fell back to prefill: {result.counters.full_prefill_reason}")
            return result
        return fn

    def measure(self, length: int, also_engine: bool = False) -> dict:
        """Full prefill once, then per ratio the blend from each tier (see :mod:`cluster.bench.gpu`)."""
        torch = self.torch
        repeats = self.args.repeats
        plan, num_chunks = self._plan(length, self.ratios[0])
        ids = list(plan.token_ids)
        prefill_engine = self.BlendEngine(self.adapter)
        full, _ = self._timed(lambda: self.run_prefill(prefill_engine, ids), repeats)
        ids_t = torch.tensor([ids], device=self.device)
        with torch.no_grad():
            full_hf, _ = self._timed(lambda: self.hf_model(ids_t, use_cache=False, logits_to_keep=1), repeats)
        prepared = gpu_graphs.prepare_graphs(self, plan)
        row = {"tokens": len(ids), "num_chunks": num_chunks, "repeats": repeats, "probe_graphs": prepared,
               "start_up": {"flex_warm": self.flex_warm, "probe_graphs": self.model_desc["probe_graphs"]},
               "full_s": full["median"], "full_min_s": full["min"], "full_max_s": full["max"],
               "full_hf_s": full_hf["median"], "disk_raw_gbps": self._disk_raw_gbps(num_chunks),
               "by_ratio": {}}
        staged = self.sources["host"].reader
        for ratio in self.ratios:
            plan, _ = self._plan(length, ratio)
            cell = {"tokens": len(ids), "ratio": ratio, "repeats": repeats, "full_s": full["median"]}
            results = {}
            pinned = getattr(staged, "pinned", None)  # None on the CPU: no staging there
            for tier in ("gpu", "host_cold", "host", "disk"):
                fn = self._blend_fn(plan, "host" if tier == "host_cold" else tier, num_chunks)
                before, keep = None, pinned.capacity_bytes if pinned is not None else 0
                if tier == "host_cold" and pinned is not None:  # no pinned copy, every run
                    pinned.capacity_bytes = 0
                    before = pinned.clear
                if tier == "host" and pinned is not None:  # hot: pinned from its 2nd use on
                    fn()
                    fn()
                    pinned.wait_idle(120)
                    staged.reset_stats()
                runs = repeats
                try:
                    t, results[tier] = self._timed(fn, runs, before)
                finally:
                    if pinned is not None:
                        pinned.capacity_bytes = keep
                cell[f"blend_{tier}_s"] = t["median"]
                cell[f"blend_{tier}_min_s"], cell[f"blend_{tier}_max_s"] = t["min"], t["max"]
                cell[f"load_wait_{tier}_s"] = results[tier].counters.load_wait_s
            cell["selection"] = self.selections[0]
            cell["probe_s"] = results["gpu"].counters.probe_s
            cell["selections"] = {sel: self._measure_selection(length, ratio, sel, num_chunks, full["median"])
                                  for sel in self.selections[1:]}
            if getattr(self.args, "probe_graphs", "off") == "both":
                cell["with_probe_graphs"] = gpu_graphs.measure_graphs(self, plan, num_chunks, full["median"])
            cell["pinned_chunks"] = pinned.stats()["num_chunks"] if pinned is not None else 0
            disk = self.sources["disk"].reader  # a staging source on CUDA, the client elsewhere
            cell["disk_read_counters"] = (disk.read_counters.snapshot() if hasattr(disk, "read_counters")
                                          else disk.stats()["client"])
            stats = staged.transfer_stats() if hasattr(staged, "transfer_stats") else None
            layer_bytes = stats.num_bytes // max(1, stats.num_copies) if stats else 0
            cell.update({
                "ratio_gpu": cell["blend_gpu_s"] / full["median"],
                "ratio_host": cell["blend_host_s"] / full["median"],
                "ratio_disk": cell["blend_disk_s"] / full["median"],
                "ratio_host_cold": cell["blend_host_cold_s"] / full["median"],
                "overlap": cell["blend_host_s"] / cell["blend_gpu_s"],
                "h2d_gbps": stats.gbps if stats else 0.0,
                "h2d_baseline_gbps": self._h2d_baseline(layer_bytes, self.spec.num_layers)
                if self.device.type == "cuda" else 0.0,
                "h2d_bytes_per_copy": layer_bytes,
                "fill_gbps": stats.fill_gbps if stats else 0.0,
                "selected_tokens": results["gpu"].counters.selected_tokens,
                "reused_tokens": results["gpu"].counters.reused_tokens,
                "recomputed_tokens_last_layer": results["gpu"].counters.recomputed_tokens_per_layer[-1],
            })
            if also_engine and ratio == self.ratios[0]:
                self._set_attention("engine")
                try:
                    t, _ = self._timed(self._blend_fn(plan, "gpu", num_chunks), repeats)
                    cell["blend_gpu_engine_attention_s"] = t["median"]
                except Exception as e:  # noqa: BLE001 - e.g. out of memory with the dense mask
                    cell["blend_gpu_engine_attention_s"] = f"{type(e).__name__}: {e}"[:300]
                finally:
                    self._set_attention(self.args.attention)
            row["by_ratio"][str(ratio)] = cell
        return row

    def _measure_selection(self, length: int, ratio: float, selection: str, num_chunks: int,
                           full_s: float) -> dict:
        """Another selection at the same length and ratio, side by side with the first: the
        gpu-tier and hot host-tier blends (the host chunks are pinned by the first
        selection's runs), medians of ``--repeats`` with min and max."""
        plan, _ = self._plan(length, ratio, selection)
        out: dict = {"selection": selection}
        for tier in ("gpu", "host"):
            t, res = self._timed(self._blend_fn(plan, tier, num_chunks), self.args.repeats)
            out.update({f"blend_{tier}_s": t["median"], f"blend_{tier}_min_s": t["min"],
                        f"blend_{tier}_max_s": t["max"], f"ratio_{tier}": t["median"] / full_s})
        out.update(probe_s=res.counters.probe_s, selected_tokens=res.counters.selected_tokens,
                   recomputed_tokens_last_layer=res.counters.recomputed_tokens_per_layer[-1])
        return out

    def _disk_raw_gbps(self, num_chunks: int) -> float:
        return ceilings.disk_raw_gbps([self.disk_tier._file(k) for k in self.keys[:num_chunks]],  # noqa: SLF001
                                      self.args.page_cache)

    def _h2d_baseline(self, nbytes: int, num_copies: int) -> float:
        return ceilings.h2d_baseline_gbps(self.device, nbytes, num_copies)

    def profile(self, length: int, path: str) -> dict:
        """Profile one host-tier blend at ``length`` (:func:`cluster.bench.gpu_ceilings.profile_blend`)."""
        plan, num_chunks = self._plan(length, 0.15 if 0.15 in self.ratios else self.ratios[0])
        return ceilings.profile_blend(self._blend_fn(plan, "host", num_chunks), self._sync, self.device, length, path)

    def close(self) -> None:
        for src in self.sources.values():
            src.close()


def compute_class(model) -> str:
    """Dotted name of the class whose code computes ``model``'s layers (the class defining its
    ``qkv``): ``blend.adapters.fused_layers.FusedLlamaLayers`` for the fast model here and for
    what :func:`blend.adapters.vllm.vllm_adapter` builds in a vLLM worker."""
    owner = next(c for c in type(model).__mro__ if "qkv" in vars(c))
    return f"{owner.__module__}.{owner.__qualname__}"


def _check_model(fast, hf_model, torch, device) -> dict:
    """Last-token logits of ``fast`` (through the engine) against HF's own forward, 256 tokens."""
    from blend.engine import BlendEngine

    ids = torch.randint(8, fast.spec.vocab_size, (256,), generator=torch.Generator().manual_seed(5)).tolist()
    got = BlendEngine(fast).prefill(ids).logits.double()
    with torch.no_grad():
        want = hf_model(torch.tensor([ids], device=device), use_cache=False).logits[0, -1].double()
    return {"rel_err": float((got - want).norm() / want.norm()),
            "argmax_match": bool(int(got.argmax()) == int(want.argmax()))}
