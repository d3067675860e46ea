"""``kvblend bench gpu``: blend TTFT on a GPU with KV from the gpu, host and disk tiers.

One run, one process, per prompt length (4K, 8K, 16K, 32K tokens by default)::

    | prefix (16) | sep | chunk 1 (512) | sep | chunk 2 (512) | ... | sep | query (32) |

* a Llama-3-8B / Mistral-7B-shaped model (32 layers, hidden 4096, 32 heads, 8 KV heads,
  head_dim 128, MLP 14336, bf16) with random weights built on the GPU:
  ``transformers.LlamaForCausalLM`` wrapped by :class:`blend.adapters.hf.HFModelAdapter`;
  the engine re-rotates, scores and selects with :mod:`blend.ops` (Triton) and, with
  ``--attention ops`` (default), attends with :func:`blend.ops.attend` (FlexAttention for
  selected rows); ``--attention engine`` swaps in the plain-torch reference
  :func:`blend.attention.attend` (where attention time goes);
* tensor parallelism (``BlendEngine(process_group=...)`` with
  :class:`blend.adapters.hf_tp.HFTensorParallelAdapter`, issue 10) is not timed here: that
  needs one process per GPU (``torchrun``), not this single-process run;
* every chunk's canonical KV is computed once and put into a :class:`tiers.gpu.GpuTier`, a
  :class:`tiers.host.HostTier` (encoded objects, raw) and a :class:`tiers.disk.DiskTier`;
* ``full_s``: :meth:`BlendEngine.prefill` (causal SDPA: flash/cuDNN, never a mask), token
  ids to first-token logits; ``full_hf_s``: the HF model's own forward, for reference;
* ``blend_{gpu,host,disk}_s``: lookup + :meth:`BlendEngine.blend` at ``--ratio`` (check
  layer 1) with KV through :class:`tiers.staging.StagedSource` over each tier; before each
  disk run the page cache is dropped (``/proc/sys/vm/drop_caches``) or, where that is not
  allowed, each file gets ``POSIX_FADV_DONTNEED`` (the JSON says which);
* ``h2d_gbps``: bytes / device time of the staging copies in the host runs (CUDA events);
  ``h2d_baseline_gbps``: a pinned ``copy_`` of the same per-layer bytes, same run;
  ``ratio_host = blend_host_s / full_s``; ``overlap = blend_host_s / blend_gpu_s``.

Medians of ``--repeats`` timed runs after one warm-up each. Random weights: timing only.
Heavy imports (torch, transformers) happen in :func:`run`; nothing here needs ray, redis,
boto3, lz4 or vllm at import time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

log = logging.getLogger(__name__)

MODEL_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=65536,
                rope_theta=500000.0)
MODEL_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rope_theta=10000.0)
NAMESPACE = "6e6368676275667a"
PREFIX_TOKENS = 16
QUERY_TOKENS = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", required=True, metavar="PATH", help="write results here")
    p.add_argument("--lengths", default="4096,8192,16384,32768", help="prompt lengths in tokens")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per cached chunk (default 512)")
    p.add_argument("--ratio", type=float, default=0.15, help="recompute ratio (default 0.15)")
    p.add_argument("--check-layer", type=int, default=1, help="check layer (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode (median; default 3)")
    p.add_argument("--attention", choices=("ops", "engine"), default="ops",
                   help="ops: blend.ops.attend in the engine (default); engine: the reference blend.attention.attend")
    p.add_argument("--engine-lengths", default="",
                   help="also time blend_gpu with --attention engine at these lengths (where time goes)")
    p.add_argument("--profile-length", type=int, default=0,
                   help="profile one gpu-tier blend at this length (a table beside the JSON)")
    p.add_argument("--model-impl", choices=("fast", "hf"), default="fast",
                   help="fast: the bench's fused BlendModel over the same weights (default); "
                        "hf: blend.adapters.hf.HFModelAdapter")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile the fast model's per-layer functions (auto: on CUDA)")
    p.add_argument("--verify-host", action="store_true",
                   help="XXH3-check host-tier layers on every read (default off: the host tier holds "
                        "this node's own memory, checked when admitted; disk reads are always checked)")
    p.add_argument("--tiny", action="store_true", help="a 4-layer toy model (smoke test, CPU ok)")
    p.add_argument("--device", default="", help="torch device (default cuda if available, else cpu)")
    p.add_argument("--disk-dir", default="", help="disk tier directory (default: a temp dir)")
    p.add_argument("--page-cache", choices=("fadvise", "drop", "keep"), default="fadvise",
                   help="before each disk run: fadvise DONTNEED on the chunk files (default), "
                        "drop: /proc/sys/vm/drop_caches (machine-wide; falls back to fadvise), keep")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _num_chunks(length: int, chunk_tokens: int) -> int:
    """Chunks (each after a 1-token separator) that bring the prompt closest to ``length``."""
    return max(1, round((length - PREFIX_TOKENS - QUERY_TOKENS - 1) / (chunk_tokens + 1)))


def _drop_page_cache(paths: list[str], how: str) -> str:
    if how == "keep":
        return "kept (warm page cache)"
    if how == "drop":
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "dropped (drop_caches)"
        except OSError:
            pass
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            return "not dropped (no drop_caches, no fadvise)"
    return "fadvise DONTNEED per file" + (" (drop_caches not allowed)" if how == "drop" else "")


def run(args: argparse.Namespace) -> int:
    import torch

    lengths = _ints(args.lengths)
    engine_lengths = set(_ints(args.engine_lengths))
    if not lengths or min(lengths) < args.chunk_tokens // 2 + PREFIX_TOKENS + QUERY_TOKENS:
        raise ValueError(f"--lengths {lengths}: each must hold at least one {args.chunk_tokens}-token chunk")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    bench = _Bench(args, device, lengths)
    results = {}
    for length in lengths:
        results[str(length)] = bench.measure(length, also_engine=length in engine_lengths)
        log.info("length %d: %s", length, results[str(length)])
    if args.profile_length:
        bench.profile(args.profile_length, args.json + ".profile.txt")
    out = {"device": bench.device_name, "torch": torch.__version__, "model": bench.model_desc,
           "attention": args.attention, "ratio": args.ratio, "check_layer": args.check_layer,
           "chunk_tokens": args.chunk_tokens, "repeats": args.repeats,
           "page_cache": bench.page_cache, "host_verify": args.verify_host, "disk_verify": True,
           "results": results}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    _print_table(results)
    bench.close()
    return 0


def _print_table(results: dict) -> None:
    cols = ("full_s", "blend_gpu_s", "blend_host_s", "blend_disk_s", "ratio_host", "h2d_gbps",
            "h2d_baseline_gbps", "overlap")
    print("tokens  " + "  ".join(f"{c:>17}" for c in cols))
    for length, r in results.items():
        print(f"{length:>6}  " + "  ".join(f"{r[c]:>17.4f}" for c in cols))


class _Bench:
    """The model, the tiers and the timing loops of one run."""

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

        self.original_attend = attention.attend  # the reference the engine used before issue 9
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

        class _Adapter(HFModelAdapter):
            def rotate_k(self, k, from_positions, to_positions):  # Triton re-rotation (a copy)
                inv_freq = self.__dict__.get("_inv_freq_dev")
                if inv_freq is None or inv_freq.device != k.device:  # no per-layer host->device copy
                    inv_freq = self.__dict__["_inv_freq_dev"] = self._inv_freq.to(k.device)
                return ops.rerotate_k_(k.clone(), from_positions, to_positions, inv_freq)

        self.adapter = _Adapter(model, model_id="bench-llama")
        self.spec = self.adapter.spec
        self.model_check = None
        if args.model_impl == "fast":
            use_compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
            fast = FastLlama(model, self.adapter.spec, self.adapter.scale, ops, use_compile)
            self.model_check = _check_model(fast, model, torch, device)
            self.adapter = fast
        self.model_desc = {k: shape[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                 "num_key_value_heads", "intermediate_size", "vocab_size")}
        self.model_desc["dtype"] = str(dtype).removeprefix("torch.")
        self.model_desc["impl"] = (
            "cluster.bench.gpu.FastLlama (fused qkv / gate_up weights of the same "
            f"LlamaForCausalLM, compile={getattr(self.adapter, 'compiled', False)})"
            if args.model_impl == "fast" else "transformers.LlamaForCausalLM + blend.adapters.hf.HFModelAdapter")
        self.model_desc["check_vs_hf_forward"] = self.model_check
        self.BlendEngine = BlendEngine
        self._set_attention(args.attention)
        self._build_chunks(max(lengths))

    # ------------------------------------------------------------------ setup
    def _set_attention(self, which: str) -> None:
        self.engine_module.attend = self.ops.attend if which == "ops" else self.original_attend

    def _build_chunks(self, max_length: int) -> None:
        torch = self.torch
        from tiers.disk import DiskTier
        from tiers.format import encode_chunk
        from tiers.gpu import GpuTier
        from tiers.host import HostTier
        from tiers.keys import segment_key
        from tiers.staging import StagedSource

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
        self.gpu_tier = GpuTier(2 * kv_bytes + (1 << 30), self.device)
        self.host_tier = HostTier(2 * kv_bytes + (1 << 30))
        self.disk_dir = self.args.disk_dir or tempfile.mkdtemp(prefix="kvblend-bench-gpu-")
        self.disk_tier = DiskTier(self.disk_dir, 2 * kv_bytes + (1 << 30), fsync=False)
        engine = self.BlendEngine(self.adapter)
        t0 = time.perf_counter()
        kv_dtype = str(self.adapter.dtype).removeprefix("torch.")
        for key, ids in zip(self.keys, self.chunk_ids, strict=False):
            kv = torch.stack(engine.prefill(ids, want_logits=False).kv)  # [L, 2, n, H, D]
            self.gpu_tier.put(key, kv)
            host = kv.cpu()
            raw = host.view(torch.uint8).view(host.shape[0], -1).numpy()
            obj = encode_chunk(key, [raw[i] for i in range(host.shape[0])], dtype=kv_dtype,
                               num_tokens=n, num_kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_dim)
            self.host_tier.put(key, obj)
            self.disk_tier.put(key, obj)
        log.info("%d chunks cached in gpu/host/disk tiers in %.1f s (%.2f GB each tier)", num_chunks,
                 time.perf_counter() - t0, kv_bytes / 1e9)
        self.sources = {"gpu": StagedSource(self.gpu_tier, self.device),
                        "host": StagedSource(self.host_tier, self.device, verify=self.args.verify_host),
                        "disk": StagedSource(self.disk_tier, self.device)}
        self.page_cache = "not dropped (no disk run yet)"

    def _plan(self, length: int):
        from blend.plan import CHUNK, PREFIX, QUERY, SEPARATOR, BlendPlan, Segment

        n = self.args.chunk_tokens
        num_chunks = _num_chunks(length, n)
        ids = list(self.prefix_ids)
        segments = [Segment(PREFIX, 0, len(ids))]
        for key, chunk in zip(self.keys[:num_chunks], self.chunk_ids[:num_chunks], strict=False):
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
                         recompute_ratios=(self.args.ratio,), blend_end=len(ids)), num_chunks

    # ------------------------------------------------------------------ timing
    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _timed(self, fn, repeats: int) -> tuple[float, object]:
        fn()  # warm-up (compiles, allocates pinned slots)
        times, last = [], None
        for _ in range(repeats):
            self._sync()
            t0 = time.perf_counter()
            last = fn()
            self._sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), last

    def _blend_fn(self, plan, tier: str, num_chunks: int):
        source = self.sources[tier]
        engine = self.BlendEngine(self.adapter, source)
        keys = self.keys[:num_chunks]
        disk_files = [self.disk_tier._file(k) for k in keys]  # noqa: SLF001 - bench only

        def fn():
            if tier == "disk":
                self._sync()
                self.page_cache = _drop_page_cache(disk_files, self.args.page_cache)
            metas = source.lookup(keys)
            if any(m is None for m in metas):
                raise RuntimeError(f"{tier} tier lost chunks")
            result = engine.blend(plan, want_logits=True)
            if result.counters.full_prefill_reason is not None:
                raise RuntimeError(f"blend fell back to prefill: {result.counters.full_prefill_reason}")
            return result
        return fn

    def measure(self, length: int, also_engine: bool = False) -> dict:
        torch = self.torch
        plan, num_chunks = self._plan(length)
        repeats = self.args.repeats
        ids = list(plan.token_ids)
        prefill_engine = self.BlendEngine(self.adapter)
        full_s, _ = self._timed(lambda: prefill_engine.prefill(ids, want_logits=True), repeats)
        ids_t = torch.tensor([ids], device=self.device)
        with torch.no_grad():
            full_hf_s, _ = self._timed(lambda: self.hf_model(ids_t, use_cache=False, logits_to_keep=1), repeats)
        gpu_s, res = self._timed(self._blend_fn(plan, "gpu", num_chunks), repeats)
        counters = res.counters
        host_src = self.sources["host"]
        host_fn = self._blend_fn(plan, "host", num_chunks)
        host_fn()  # warm-up outside the stats
        host_src.reset_stats()
        host_s, host_res = self._timed(host_fn, repeats)
        stats = host_src.transfer_stats()
        disk_s, disk_res = self._timed(self._blend_fn(plan, "disk", num_chunks), max(1, repeats - 1))
        disk_raw_gbps = self._disk_raw_gbps(num_chunks)
        layer_bytes = stats.num_bytes // max(1, stats.num_copies)
        baseline = self._h2d_baseline(layer_bytes, self.spec.num_layers) if self.device.type == "cuda" else 0.0
        row = {
            "num_tokens": len(ids), "num_chunks": num_chunks,
            "full_s": full_s, "full_hf_s": full_hf_s,
            "blend_gpu_s": gpu_s, "blend_host_s": host_s, "blend_disk_s": disk_s,
            "ratio_gpu": gpu_s / full_s, "ratio_host": host_s / full_s, "ratio_disk": disk_s / full_s,
            "h2d_gbps": stats.gbps, "h2d_baseline_gbps": baseline,
            "h2d_bytes_per_copy": layer_bytes,
            "overlap": host_s / gpu_s, "disk_raw_gbps": disk_raw_gbps,
            "selected_tokens": counters.selected_tokens, "reused_tokens": counters.reused_tokens,
            "recomputed_tokens_last_layer": counters.recomputed_tokens_per_layer[-1],
            "load_wait_gpu_s": counters.load_wait_s, "load_wait_host_s": host_res.counters.load_wait_s,
            "load_wait_disk_s": disk_res.counters.load_wait_s,
            "disk_read_counters": self.sources["disk"].read_counters.snapshot(),
        }
        if also_engine:
            self._set_attention("engine")
            try:
                row["blend_gpu_engine_attention_s"], _ = self._timed(self._blend_fn(plan, "gpu", num_chunks), repeats)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory with the dense mask
                row["blend_gpu_engine_attention_s"] = f"{type(e).__name__}: {e}"[:300]
            finally:
                self._set_attention(self.args.attention)
        return row

    def _disk_raw_gbps(self, num_chunks: int) -> float:
        """GB/s of reading the chunk files whole (8 threads, page cache dropped as for the
        disk runs, no checksums): the disk's own ceiling for the disk tier."""
        from concurrent.futures import ThreadPoolExecutor

        paths = [self.disk_tier._file(k) for k in self.keys[:num_chunks]]  # noqa: SLF001 - bench only
        _drop_page_cache(paths, self.args.page_cache)

        def read(path: str) -> int:
            with open(path, "rb", buffering=0) as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                return f.readinto(buf)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            total = sum(pool.map(read, paths))
        return total / (time.perf_counter() - t0) / 1e9

    def _h2d_baseline(self, nbytes: int, num_copies: int) -> float:
        """GB/s of ``num_copies`` pinned ``copy_`` of ``nbytes`` each, on a side stream."""
        torch = self.torch
        if nbytes <= 0:
            return 0.0
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        stream = torch.cuda.Stream(self.device)
        best = 0.0
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
                for _ in range(num_copies):
                    dst.copy_(src, non_blocking=True)
                end.record()
            end.synchronize()
            best = max(best, nbytes * num_copies / (start.elapsed_time(end) / 1e3) / 1e9)
        return best

    def profile(self, length: int, path: str) -> None:
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile

        plan, num_chunks = self._plan(length)
        fn = self._blend_fn(plan, "host", num_chunks)
        fn()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            fn()
            self._sync()
        table = prof.key_averages()
        with open(path, "w") as f:
            f.write(f"one host-tier blend at {length} tokens\n\n== by self CPU time ==\n")
            f.write(table.table(sort_by="self_cpu_time_total", row_limit=30))
            if self.device.type == "cuda":
                f.write("\n\n== by device time ==\n")
                try:
                    f.write(table.table(sort_by="device_time_total", row_limit=30))
                except (KeyError, AttributeError, RuntimeError):
                    f.write(table.table(sort_by="cuda_time_total", row_limit=30))
        del torch

    def close(self) -> None:
        for src in self.sources.values():
            src.close()


def _check_model(fast, hf_model, torch, device) -> dict:
    """Last-token logits of ``fast`` (through the engine) against HF's own forward, 256 tokens."""
    from blend.engine import BlendEngine

    ids = torch.randint(8, fast.spec.vocab_size, (256,), generator=torch.Generator().manual_seed(5)).tolist()
    got = BlendEngine(fast).prefill(ids).logits.double()
    with torch.no_grad():
        want = hf_model(torch.tensor([ids], device=device), use_cache=False).logits[0, -1].double()
    return {"rel_err": float((got - want).norm() / want.norm()),
            "argmax_match": bool(int(got.argmax()) == int(want.argmax()))}


class FastLlama:
    """A :class:`blend.protocols.BlendModel` over a ``LlamaForCausalLM``'s weights, built for
    few kernel launches: fused ``q|k|v`` and ``gate|up`` weight matrices (one GEMM each),
    RoPE from a precomputed cos/sin table, and (``use_compile``) the per-layer ``qkv`` and
    ``finish_layer`` math compiled by ``torch.compile`` (dynamic row counts), so norms, RoPE
    and SiLU-mul fuse into the GEMMs' neighbours. Same math as HF's Llama layer (RMSNorm in
    float32, RoPE cos/sin rounded to the model dtype as HF does).

    Why: eager HF modules cost ~45 kernel launches and ~1 ms of Python per layer, which at
    15% of 4K-8K rows is longer than the GPU work (measured on the H200, 2026-11-29).
    """

    def __init__(self, hf_model, spec, scale: float, ops, use_compile: bool) -> None:
        import torch
        import torch.nn.functional as F

        self.torch, self.ops, self.spec, self.scale = torch, ops, spec, scale
        core = hf_model.model
        self._embed = core.embed_tokens.weight
        self._device, self._dtype = self._embed.device, self._embed.dtype
        self.eps = float(hf_model.config.rms_norm_eps)
        with torch.no_grad():
            self._layers = [tuple(w.detach() for w in (
                layer.input_layernorm.weight,
                torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                           layer.self_attn.v_proj.weight]).contiguous(),        # [(Hq+2H)*D, E]
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).contiguous(),  # [2F, E]
                layer.mlp.down_proj.weight)) for layer in core.layers]
            self._norm, self._lm_head = core.norm.weight.detach(), hf_model.lm_head.weight.detach()
            self._inv_freq = core.rotary_emb.inv_freq.detach().to(self._device, torch.float32)
            self.inv_freq = self._inv_freq  # what the engine re-rotates cached K with
            scaling = float(getattr(core.rotary_emb, "attention_scaling", 1.0))
            max_pos = max(spec.max_position, 1)
            freqs = torch.outer(torch.arange(max_pos, device=self._device, dtype=torch.float32), self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)                                  # [P, D]
            self._cos = (emb.cos() * scaling).to(self._dtype)
            self._sin = (emb.sin() * scaling).to(self._dtype)
        num_heads, num_kv, head_dim, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, self.eps

        def rms(x, w):
            return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

        def rope(x, cos, sin):
            half = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        def qkv(residual, norm_w, wqkv, cos, sin):
            t = residual.shape[0]
            out = rms(residual, norm_w) @ wqkv.t()
            q, k, v = out.split([num_heads * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
            q = rope(q.view(t, num_heads, head_dim), cos[:, None], sin[:, None])
            k = rope(k.view(t, num_kv, head_dim), cos[:, None], sin[:, None])
            return q, k, v.reshape(t, num_kv, head_dim)

        def finish(attn_out, residual, wo, norm_w, wgu, wdown):
            residual = residual + attn_out @ wo.t()
            gate, up = (rms(residual, norm_w) @ wgu.t()).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ wdown.t(), residual

        self._qkv_eager, self._finish_eager = qkv, finish
        self._qkv, self._finish = qkv, finish
        self.compiled = False
        if use_compile:
            self._qkv = torch.compile(qkv, dynamic=True)
            self._finish = torch.compile(finish, dynamic=True)
            self.compiled = True

    @property
    def device(self):
        return self._device

    @property
    def dtype(self):
        return self._dtype

    def _call(self, name: str, *args):
        try:
            return getattr(self, name)(*args)
        except Exception as e:  # noqa: BLE001 - compile failure: stay correct, say so
            if not self.compiled:
                raise
            log.warning("torch.compile of the bench model failed (%s: %s); running eager", type(e).__name__, e)
            self._qkv, self._finish, self.compiled = self._qkv_eager, self._finish_eager, False
            return getattr(self, name)(*args)

    def embed(self, token_ids):
        return self._embed[token_ids.to(self._device)]                               # [T, E]

    def qkv(self, layer_idx, hidden, residual, positions):
        with self.torch.no_grad():
            residual = hidden if residual is None else hidden + residual
            w = self._layers[layer_idx]
            pos = positions.to(self._device)
            q, k, v = self._call("_qkv", residual, w[0], w[1], self._cos[pos], self._sin[pos])
            return q, k, v, residual

    def rotate_k(self, k, from_positions, to_positions):
        return self.ops.rerotate_k_(k.clone(), from_positions, to_positions, self._inv_freq)

    def finish_layer(self, layer_idx, attn_out, residual):
        with self.torch.no_grad():
            w = self._layers[layer_idx]
            return self._call("_finish", attn_out, residual, w[2], w[3], w[4], w[5])

    def logits(self, hidden, residual):
        with self.torch.no_grad():
            x = hidden + residual
            normed = self._norm * self.torch.nn.functional.rms_norm(
                x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
            return (normed @ self._lm_head.t()).float()                              # [T, V]
