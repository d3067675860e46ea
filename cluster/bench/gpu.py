"""``kvblend bench gpu``: blend TTFT on a GPU with KV from the gpu, host and disk tiers.

One process per prompt length (4K, 8K, 16K, 32K tokens by default; this command starts a
child per length and merges their JSON)::

    | prefix (16) | sep | chunk 1 (512) | sep | chunk 2 (512) | ... | sep | query (32) |

* a Llama-3-8B / Mistral-7B-shaped model (32 layers, hidden 4096, 32 heads, 8 KV heads,
  head_dim 128, MLP 14336, bf16) with random weights built on the GPU:
  ``transformers.LlamaForCausalLM`` served through the product's adapter
  :class:`blend.adapters.fused_llama.FusedLlamaAdapter` (``--model-impl hf``:
  :class:`blend.adapters.hf.HFModelAdapter`); the engine attends with
  :func:`blend.ops.causal_attention` (``--attention engine``: the plain-torch reference);
* the KV sources are the vLLM worker's: :func:`cluster.vllm.worker_source.build_worker_source`
  over the machine-local client (:class:`cluster.cache.local.LocalCacheClient`) of a
  :class:`tiers.host.HostTier` (host) or a :class:`tiers.disk.DiskTier` (disk; the page cache
  dropped before each run, see ``--page-cache``), and that builder's gpu tier (gpu). On CUDA
  the builder stages through pinned memory (:class:`tiers.staging.StagedSource`). The Ray
  object-store leg of a Ray client is not here (no Ray on the GPU machine): ``kvblend bench
  cluster`` measures it on CPU;
* ``full_s``: :meth:`BlendEngine.prefill` with the same adapter, attention and compile
  setting in the same process, token ids to first-token logits; ``full_hf_s``: HF's own
  forward, for reference;
* ``blend_{gpu,host,disk}_s``: lookup + :meth:`BlendEngine.blend` per ``--ratios`` (check
  layer 1), synchronized, to first-token logits;
* ``blend_host_s`` is a hot chunk's (used before: the source keeps it in pinned memory,
  :mod:`tiers.pinned`), ``blend_host_cold_s`` one with no pinned copy (every layer filled
  into a pinned slot first);
* ``h2d_gbps``: bytes / device time of the hot host runs' copies (CUDA events);
  ``h2d_baseline_gbps``: a pinned ``copy_`` of the same per-layer bytes, same run;
  ``ratio_host = blend_host_s / full_s``; ``overlap = blend_host_s / blend_gpu_s``.

Medians of ``--repeats`` timed runs after one warm-up each, with min and max. Pools, compiled
kernels and sources are built before timing (``build_s``). Random weights: timing only. This
module is the command (flags, children, merged JSON, table, ``--plot``);
:mod:`cluster.bench.gpu_harness` holds the model, tiers and timing loops. Heavy imports
(torch, transformers) happen in :func:`run`; nothing here needs ray, redis, boto3 or vllm.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile

from cluster.bench.gpu_harness import PREFIX_TOKENS, QUERY_TOKENS

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", required=True, metavar="PATH", help="write results here")
    p.add_argument("--lengths", default="4096,8192,16384,32768", help="prompt lengths in tokens")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per cached chunk (default 512)")
    p.add_argument("--ratios", default="", help="recompute ratios (default 0.05,0.15,0.30; with --placement "
                                                "or --client the product's default ratio)")
    p.add_argument("--check-layer", type=int, default=1, help="check layer (default 1)")
    p.add_argument("--selection", default="query_attention,k_deviation",
                   help="token selections, comma-separated: the first is timed from every tier, the others "
                        "from the gpu and hot host tiers beside it (default query_attention,k_deviation)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per cell (median; default 7)")
    p.add_argument("--attention", choices=("ops", "engine"), default="ops",
                   help="ops: blend.ops.causal_attention in the engine (default); "
                        "engine: the reference blend.attention.blocked_row_attention")
    p.add_argument("--engine-lengths", default="",
                   help="also time blend_gpu with --attention engine at these lengths (where time goes)")
    p.add_argument("--profile-length", type=int, default=0,
                   help="profile one host-tier blend at this length (a table beside the JSON)")
    p.add_argument("--model-impl", choices=("fast", "hf"), default="fast",
                   help="fast: blend.adapters.fused_llama.FusedLlamaAdapter (default); "
                        "hf: blend.adapters.hf.HFModelAdapter")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile the fused adapter's per-layer functions (auto: on CUDA)")
    p.add_argument("--probe-graphs", choices=("off", "on", "both"), default=None,
                   help="the query probe's per-layer CUDA graphs (blend.probe_graphs), captured before timing as a "
                        "vLLM worker captures them: every bucket up to the longest prompt or blend.probe_graph_tokens, "
                        "whichever is less (a longer prompt probes eagerly, as in a worker); on: every blend; both: "
                        "each cell also times the gpu and hot host tiers with graphs, run by run beside the runs "
                        "without (default: on when on CUDA and blend.probe_graph_tokens > 0, as a worker runs)")
    p.add_argument("--tiny", action="store_true", help="a 4-layer toy model (smoke test, CPU ok)")
    p.add_argument("--device", default="", help="torch device (default cuda if available, else cpu)")
    p.add_argument("--disk-dir", default="", help="disk tier directory (default: a temp dir)")
    p.add_argument("--page-cache", choices=("fadvise", "drop", "keep"), default="fadvise",
                   help="before each disk run: fadvise DONTNEED on the chunk files (default), "
                        "drop: /proc/sys/vm/drop_caches (machine-wide; falls back to fadvise), keep")
    p.add_argument("--in-process", action="store_true",
                   help="measure every length in this process (default: one child process per length)")
    p.add_argument("--client", default="", metavar="NAMES",
                   help="instead of the tiers: the shared cache's path to the GPU through these clients "
                        "(agent,ray,local: cluster.bench.gpu_clients; needs ray)")
    p.add_argument("--placement", default="", metavar="NAMES",
                   help="instead of the tiers: full prefill, always-load and cost-aware plans by where the "
                        "chunks sit (gpu,host_hot,host_cold,disk,slow,mixed: cluster.bench.gpu_placement; "
                        "'all' for every one)")
    p.add_argument("--churn-lengths", default="8192", help="with --client: lengths that also get a churn row")
    p.add_argument("--arena-gib", type=float, default=0.0,
                   help="with --client: the agent's arena (agent_arena_gib; default: the config's)")
    p.add_argument("--plot", default="", metavar="PNG",
                   help="only draw this PNG from --json (blend time per tier and length beside full prefill)")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or any(not 0 < r <= 1 for r in out):
        raise ValueError(f"--ratios {text!r}: each must be in (0, 1]")
    return out


def run(args: argparse.Namespace) -> int:
    """Measure every ``--lengths`` prompt (one child process each), write the JSON, print the table."""
    if args.plot:
        plot(args.json, args.plot)
        return 0
    lengths = _ints(args.lengths)
    if not args.ratios:  # the placement and client benches time the product's own default ratio
        from blend.config import BlendConfig

        args.ratios = (",".join(map(str, BlendConfig().recompute_ratios[:1])) if args.placement or args.client
                       else "0.05,0.15,0.30")
    args.ratios = _floats(args.ratios) if isinstance(args.ratios, str) else args.ratios
    if isinstance(args.selection, str):
        from blend.config import parse_selections

        args.selection = parse_selections(args.selection)
    if not lengths or min(lengths) < args.chunk_tokens // 2 + PREFIX_TOKENS + QUERY_TOKENS:
        raise ValueError(f"--lengths {lengths}: each must hold at least one {args.chunk_tokens}-token chunk")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    if args.placement:
        from cluster.bench.gpu_placement import PLACEMENTS, print_rows, run_placements

        args.placement = list(PLACEMENTS) if args.placement == "all" else [p for p in args.placement.split(",") if p]
        if not set(args.placement) <= set(PLACEMENTS):
            raise ValueError(f"--placement {args.placement}: each one of {PLACEMENTS}")
        def write(out: dict) -> None:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)

        out = run_placements(args, lengths, partial=write)
        write(out)
        print_rows(out)
        return 0
    if args.client:
        from cluster.bench.gpu_clients import CLIENTS, print_rows, run_clients

        args.client = [c for c in args.client.split(",") if c]
        if not set(args.client) <= set(CLIENTS):
            raise ValueError(f"--client {args.client}: each one of {CLIENTS}")
        args.churn_lengths = _ints(args.churn_lengths)
        out = run_clients(args, lengths)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print_rows(out)
        return 0
    out = _in_process(args, lengths) if args.in_process or len(lengths) == 1 else _children(args, lengths)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    _print_table(out["results"])
    return 0


def _in_process(args: argparse.Namespace, lengths: list[int]) -> dict:
    import torch

    from cluster.bench.gpu_harness import GpuBench

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bench = GpuBench(args, device, lengths)
    engine_lengths = set(_ints(args.engine_lengths))
    results, profile = {}, None
    for length in lengths:
        results[str(length)] = bench.measure(length, also_engine=length in engine_lengths)
        log.info("length %d: %s", length, results[str(length)])
    if args.profile_length in lengths:
        profile = bench.profile(args.profile_length, args.json + ".profile.txt")
    out = {"device": bench.device_name, "torch": torch.__version__, "model": bench.model_desc,
           "attention": args.attention, "ratios": args.ratios, "check_layer": args.check_layer,
           "selections": args.selection,
           "chunk_tokens": args.chunk_tokens, "repeats": args.repeats, "page_cache": bench.page_cache,
           "build_s": bench.build_s, "source": "cluster.vllm.worker_source.build_worker_source over "
           "cluster.cache.local.LocalCacheClient", "results": results}
    if profile is not None:
        out["profile"] = {str(args.profile_length): profile}
    bench.close()
    return out


def _children(args: argparse.Namespace, lengths: list[int]) -> dict:
    """One child process per length (a fresh CUDA context, allocator and compile cache each);
    their JSON merged, in order."""
    merged: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvblend-bench-gpu-") as tmp:
        for length in lengths:
            part = os.path.join(tmp, f"{length}.json")
            argv = [sys.executable, "-m", "cluster.cli.main", "bench", "gpu", "--in-process",
                    "--json", part, "--lengths", str(length)] + _forwarded(args)
            subprocess.run(argv, check=True, timeout=3600)
            with open(part) as f:
                got = json.load(f)
            prof = os.path.join(tmp, f"{length}.json.profile.txt")
            if os.path.exists(prof):
                with open(prof) as src, open(args.json + ".profile.txt", "w") as dst:
                    dst.write(src.read())
            results, profile = got.pop("results"), got.pop("profile", {})
            merged.setdefault("results", {}).update(results)
            merged.setdefault("profile", {}).update(profile)
            merged.update({k: v for k, v in got.items() if k not in merged})
    return merged


def _forwarded(args: argparse.Namespace) -> list[str]:
    argv = ["--chunk-tokens", str(args.chunk_tokens), "--ratios", ",".join(map(str, args.ratios)),
            "--check-layer", str(args.check_layer), "--selection", ",".join(args.selection),
            "--repeats", str(args.repeats),
            "--attention", args.attention, "--model-impl", args.model_impl, "--compile", args.compile,
            "--page-cache", args.page_cache]
    for flag, value in (("--engine-lengths", args.engine_lengths), ("--profile-length", args.profile_length),
                        ("--probe-graphs", args.probe_graphs),
                        ("--device", args.device), ("--disk-dir", args.disk_dir)):
        if value:
            argv += [flag, str(value)]
    return argv + (["--tiny"] if args.tiny else [])


def _print_table(results: dict) -> None:
    cols = ("full_s", "blend_gpu_s", "blend_host_s", "blend_host_cold_s", "blend_disk_s", "ratio_host",
            "overlap", "h2d_gbps", "h2d_baseline_gbps")
    print("tokens  ratio  " + "  ".join(f"{c:>17}" for c in cols))
    for length, r in results.items():
        for ratio, cell in r["by_ratio"].items():
            print(f"{length:>6}  {float(ratio):>5.2f}  " + "  ".join(f"{cell[c]:>17.4f}" for c in cols))
            spread = "  ".join(f"{t}: {cell[f'blend_{t}_min_s']:.4f}-{cell[f'blend_{t}_max_s']:.4f}"
                               for t in ("gpu", "host", "host_cold", "disk"))
            print(f"{'':>6}  {'':>5}  min-max s  full: {r['full_min_s']:.4f}-{r['full_max_s']:.4f}  {spread}")
            for sel, other in [(cell.get("selection", ""), cell)] + list(cell.get("selections", {}).items()):
                print(f"{'':>6}  {'':>5}  {sel:>17}  gpu {other['blend_gpu_s']:.4f} s ({other['ratio_gpu']:.3f} of full)  "
                      f"host {other['blend_host_s']:.4f} s ({other['ratio_host']:.3f})  probe {other['probe_s']:.4f} s")


def plot(json_path: str, png_path: str, ratio: str = "0.15") -> None:
    """Blend time per tier and prompt length beside full prefill (medians, min-max bars), at
    ``ratio`` (or the first ratio measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    lengths = list(data["results"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("full prefill", "full_s", "full_min_s", "full_max_s", None)] + [
        (f"blend, {t.replace('_', ' ')}", f"blend_{t}_s", f"blend_{t}_min_s", f"blend_{t}_max_s", t)
        for t in ("gpu", "host", "host_cold", "disk")]
    width = 0.8 / len(series)
    for j, (label, key, lo, hi, tier) in enumerate(series):
        meds, errs = [], [[], []]
        for length in lengths:
            r = data["results"][length]
            cell = r["by_ratio"].get(ratio) or next(iter(r["by_ratio"].values()))
            src = r if tier is None else cell
            meds.append(src[key])
            errs[0].append(src[key] - src[lo])
            errs[1].append(src[hi] - src[key])
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(lengths))]
        ax.bar(xs, meds, width, yerr=errs, capsize=2, label=label)
    ax.set_xticks(range(len(lengths)), [f"{int(n) // 1024}K" for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("seconds to first-token logits")
    ax.set_yscale("log")
    ax.set_title(f"{data.get('device', '')}: blend (ratio {ratio}) vs full prefill")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
