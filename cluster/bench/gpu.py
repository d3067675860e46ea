"""``kvblend bench gpu``: blend TTFT on a GPU with KV from the gpu, host and disk tiers.

One run, one process, per prompt length (4K, 8K, 16K, 32K tokens by default)::

    | prefix (16) | sep | chunk 1 (512) | sep | chunk 2 (512) | ... | sep | query (32) |

* a Llama-3-8B / Mistral-7B-shaped model (32 layers, hidden 4096, 32 heads, 8 KV heads,
  head_dim 128, MLP 14336, bf16) with random weights built on the GPU:
  ``transformers.LlamaForCausalLM`` wrapped by :class:`blend.adapters.hf.HFModelAdapter`;
  the engine re-rotates, scores and selects with :mod:`blend.ops` (Triton) and, with
  ``--attention ops`` (default), attends with :func:`blend.ops.causal_attention` (FlexAttention
  for selected rows); ``--attention engine`` swaps in the plain-torch reference
  :func:`blend.attention.blocked_row_attention` (where attention time goes);
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
This module is the command (flags, run, table); :mod:`cluster.bench.gpu_harness` holds the
model, tiers and timing loops, :mod:`cluster.bench.fast_llama` the fused bench model. Heavy
imports (torch, transformers) happen in :func:`run`; nothing here needs ray, redis, boto3, lz4
or vllm at import time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from cluster.bench.gpu_harness import PREFIX_TOKENS, QUERY_TOKENS

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", required=True, metavar="PATH", help="write results here")
    p.add_argument("--lengths", default="4096,8192,16384,32768", help="prompt lengths in tokens")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per cached chunk (default 512)")
    p.add_argument("--ratio", type=float, default=0.15, help="recompute ratio (default 0.15)")
    p.add_argument("--check-layer", type=int, default=1, help="check layer (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode (median; default 3)")
    p.add_argument("--attention", choices=("ops", "engine"), default="ops",
                   help="ops: blend.ops.causal_attention in the engine (default); "
                        "engine: the reference blend.attention.blocked_row_attention")
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


def run(args: argparse.Namespace) -> int:
    """Measure every ``--lengths`` prompt (and profile one), write the JSON, print the table."""
    import torch

    lengths = _ints(args.lengths)
    engine_lengths = set(_ints(args.engine_lengths))
    if not lengths or min(lengths) < args.chunk_tokens // 2 + PREFIX_TOKENS + QUERY_TOKENS:
        raise ValueError(f"--lengths {lengths}: each must hold at least one {args.chunk_tokens}-token chunk")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    from cluster.bench.gpu_harness import GpuBench

    bench = GpuBench(args, device, lengths)
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
