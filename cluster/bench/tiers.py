"""``kvblend bench tiers``: throughput of every tier against the plain path for the same bytes.

Chunks are shaped like a 7B model's (32 layers, 8 KV heads, head dim 128, 256 tokens, bf16:
1 MiB a layer, 32 MiB a chunk). For each tier (host, disk, redis, s3, and gpu on this
machine's device) and for lz4 off and on, in one process:

* ``put_gbps``: encode a chunk object from the KV buffer (``tiers.format.encode_chunk``,
  checksums, lz4 when on) and ``put`` it; KV bytes per second.
* ``get_gbps``: whole chunk via :func:`tiers.reader.read_layers` (header probe, ranged read
  of the layers, XXH3 checks, lz4 decode) into a preallocated ``[L, 2, T, H, D]`` caller
  buffer; KV bytes per second.
* ``baseline_gbps``: the fastest plain path for the same stored object into a preallocated
  caller buffer: ``copy_`` (host, gpu), ``readinto`` of the file (disk; the page cache is
  warm for both; ``*_cold`` numbers drop the file's pages with ``posix_fadvise`` before
  each read, for both), a plain redis-py ``GET`` + copy (redis), a plain boto3
  ``get_object`` + copy (s3); counted in the same KV bytes so ``ratio = get/baseline``.
* ``layer_get_gbps``: one random layer at a time into a 1 MiB buffer (header cached, as the
  stack and client do).

Timings take the best of ``--reps`` passes over ``--chunks`` chunks, ours and the baseline
interleaved. The tier's top-level numbers are its default setting (lz4 below memory:
disk/redis/s3; raw in memory: host/gpu). ``lz4`` reports compression ratio and decompress
GB/s on real KV of the default model (SmolLM2, computed here with transformers on a QA
passage), on random bytes, and (not a stored codec, evidence for one) on the same real KV
with bf16 high and low bytes split into two planes. The chunk data itself is that real KV, laid out in the 7B
shape (so lz4 sees real value statistics); without the model it falls back to random
normal bf16 and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import tempfile
import time

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, NUM_TOKENS = 32, 8, 128, 256
ALL_TIERS = ("host", "disk", "redis", "s3", "gpu")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    p.add_argument("--quick", action="store_true", help="fewer chunks and passes (< 2 min on 2 cores)")
    p.add_argument("--tiers", default=",".join(ALL_TIERS), help=f"comma list from {','.join(ALL_TIERS)}")
    p.add_argument("--chunks", type=int, default=None, help="chunks per pass (default 2 quick / 6)")
    p.add_argument("--reps", type=int, default=None, help="passes (default 3 quick / 5); best is kept")
    p.add_argument("--redis-url", default="", help="use this Redis instead of starting one (rediss://: "
                   "the TLS files come from the kvblend config, e.g. KVBLEND_REDIS_TLS_CA_FILE)")
    p.add_argument("--redis-tls", action="store_true",
                   help="without --redis-url: start the Redis with TLS only (a throwaway CA)")
    p.add_argument("--s3-url", default="", help="s3://bucket/prefix to use instead of starting moto")
    p.add_argument("--s3-endpoint-url", default="", help="endpoint for --s3-url")
    p.add_argument("--disk-path", default="", help="directory for the disk tier (default: a temp dir)")
    p.add_argument("--device", default="", help="device of the gpu tier (default cuda if present, else cpu)")
    p.add_argument("--object-key", action="store_true",
                   help="also measure each tier's default setting with object authentication on "
                        "(tiers.auth; a random key in this process): rows 'auth' and 'auth_get_ratio'")
    p.add_argument("--model", default="smollm2", help="model whose real KV feeds the chunks and lz4 numbers ('random': random normal bf16)")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / 1e9 / seconds if seconds > 0 else float("inf")


def _sig(value: float) -> float:
    """4 significant digits (GB/s of tiny test shapes are small numbers)."""
    return float(f"{value:.4g}")


def _best(fn, reps: int, prepare=None) -> float:
    """Best wall time of ``reps`` calls of ``fn`` (``prepare()`` runs untimed before each)."""
    best = float("inf")
    for _ in range(reps):
        if prepare is not None:
            prepare()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def real_kv_values(model: str, num_values: int, log) -> tuple[object, str]:
    """Flat bf16 tensor of ``num_values`` real K/V values from ``model`` (tiled if short),
    and a description of the source; random normal bf16 when the model is unavailable."""
    import torch

    try:
        if model == "random":
            raise ValueError("--model random asks for random KV")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from cluster.config import cache_dir, load_config
        from cluster.workloads.model import resolve_model

        path = resolve_model(model, cache_dir(load_config(environ={})), prepare=False)
        tok = AutoTokenizer.from_pretrained(path)
        # fp32 compute: this CPU's bf16 matmuls were 5x slower; the KV is stored as bf16
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        lm.eval()
        text = _passages(384 * 6)
        ids = tok(text, return_tensors="pt").input_ids[:, :384]  # tiled to the 7B shape below
        with torch.no_grad():
            cache = lm(ids, use_cache=True).past_key_values
        parts = []
        for layer in cache.layers:
            parts += [layer.keys.flatten(), layer.values.flatten()]
        flat = torch.cat(parts).to(torch.bfloat16)
        source = (f"{model}: real K/V of {len(cache.layers)} layers x {ids.shape[1]} tokens of a QA "
                  f"passage (fp32 compute, stored bf16), laid out in the 7B shape")
    except Exception as e:  # noqa: BLE001 - no model here: still measure, and say so
        log(f"[yellow]real KV unavailable ({type(e).__name__}: {e}); using random normal bf16")
        flat = torch.randn(num_values).to(torch.bfloat16)
        source = "random normal bf16 (model unavailable)"
    reps = -(-num_values // flat.numel())
    return flat.repeat(reps)[:num_values].contiguous(), source


def _passages(min_chars: int) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.path.join(here, "..", "..", "..", "shared", "data", "qa"),
                 os.path.join(here, "..", "data")):
        path = os.path.join(root, "musique_s.norm.jsonl")
        if os.path.exists(path):
            out = []
            with open(path) as fh:
                for line in fh:
                    out += json.loads(line)["passages"]
                    if sum(map(len, out)) >= min_chars:
                        break
            return "\n\n".join(out)
    # no QA data: a deterministic English-ish text still gives real activations
    words = "the cache stores key value tensors for every passage a model has read".split()
    rng = random.Random(0)
    return " ".join(rng.choice(words) for _ in range(min_chars // 5))


def lz4_numbers(kv_flat, reps: int) -> dict:
    """lz4 ratio and decompress GB/s per 1 MiB layer, on real KV and on random bytes."""
    import lz4.block
    import torch

    layer_bytes = 2 * NUM_TOKENS * NUM_KV_HEADS * HEAD_DIM * 2
    raw_all = kv_flat.view(torch.uint8).numpy()
    n = max(1, min(8, raw_all.nbytes // layer_bytes))
    samples = {
        "real_kv": [raw_all[i * layer_bytes:(i + 1) * layer_bytes].tobytes() for i in range(n)],
        "random_bytes": [os.urandom(layer_bytes) for _ in range(n)],
    }
    # Not a stored codec: what lz4 would get if bf16 high bytes (sign, exponent) and low
    # bytes (mantissa) were split into two planes first -- evidence for a future codec.
    samples["real_kv_byte_planes"] = [
        b"".join(bytes(memoryview(x)[j::2]) for j in (1, 0)) for x in samples["real_kv"]]
    out = {}
    for name, layers in samples.items():
        packed = [lz4.block.compress(x, store_size=False) for x in layers]
        seconds = _best(lambda packed=packed: [lz4.block.decompress(p, uncompressed_size=layer_bytes)
                                                for p in packed], reps)
        seconds_c = _best(lambda layers=layers: [lz4.block.compress(x, store_size=False) for x in layers], 1)
        out[name] = {"ratio": round(sum(map(len, layers)) / sum(map(len, packed)), 4),
                     "decompress_gbps": round(_gbps(len(layers) * layer_bytes, seconds), 3),
                     "compress_gbps": round(_gbps(len(layers) * layer_bytes, seconds_c), 3)}
    return out


class _Bench:
    """One tier's measurements; ``chunks`` is a list of ``(key, kv [L,2,T,H,D] bf16)``."""

    def __init__(self, name, tier, chunks, out, reps, rng):
        self.name, self.tier, self.chunks, self.out, self.reps, self.rng = name, tier, chunks, out, reps, rng
        self.kv_bytes = out.numel() * out.element_size()

    def run(self, compress: bool) -> dict:
        import torch

        from tiers.codec import encode_kv
        from tiers.reader import read_header, read_layers

        keys = [k for k, _ in self.chunks]
        total = self.kv_bytes * len(keys)
        # put: encode + store, on fresh keys each pass so nothing is a no-op
        put_s = float("inf")
        for rep in range(self.reps):
            fresh = [_variant(k, f"{int(compress)}{rep}") for k in keys]
            t0 = time.perf_counter()
            for k, (_, kv) in zip(fresh, self.chunks, strict=False):
                if not self.tier.put(k, encode_kv(k, kv, compress=compress)):
                    raise RuntimeError(f"{self.name}: put failed (see log)")
            put_s = min(put_s, time.perf_counter() - t0)
            if rep < self.reps - 1:
                self.tier.delete(fresh)
        stored = fresh
        views = [self.out[i].view(torch.uint8).view(-1).numpy() for i in range(NUM_LAYERS)]
        headers = [read_header(self.tier, k) for k in stored]
        ref = self.chunks[0][1]
        for k in stored[:1]:  # correctness once: bit-exact
            if read_layers(self.tier, k, range(NUM_LAYERS), views) is None or not torch.equal(self.out, ref):
                raise RuntimeError(f"{self.name}: read back differs")

        def ours():
            for k in stored:
                if read_layers(self.tier, k, range(NUM_LAYERS), views) is None:
                    raise RuntimeError(f"{self.name}: miss")

        def layers():
            for k, h in zip(stored, headers, strict=False):
                for _ in range(4):
                    i = self.rng.randrange(NUM_LAYERS)
                    read_layers(self.tier, k, [i], [views[i]], header=h)

        baseline, cold = self.baseline(stored)
        get_s = base_s = float("inf")
        passes = self.reps * (3 if self.name in ("host", "disk") else 1)  # cheap: more passes
        for _ in range(passes):  # interleaved so drift hits both alike
            get_s = min(get_s, _best(ours, 1))
            base_s = min(base_s, _best(baseline, 1))
        layer_s = _best(layers, self.reps)
        row = {"get_gbps": _gbps(total, get_s), "put_gbps": _gbps(total, put_s),
               "baseline_gbps": _gbps(total, base_s), "layer_get_gbps": _gbps(4 * len(stored) * self.kv_bytes // NUM_LAYERS, layer_s),
               "stored_bytes_per_chunk": len(bytes(self.tier.get(stored[0])))}
        row["ratio"] = row["get_gbps"] / row["baseline_gbps"]
        if cold is not None:
            drop, cold_base = cold
            row["get_gbps_cold"] = _gbps(total, _best(ours, self.reps, prepare=drop))
            row["baseline_gbps_cold"] = _gbps(total, _best(cold_base, self.reps, prepare=drop))
            row["ratio_cold"] = row["get_gbps_cold"] / row["baseline_gbps_cold"]
        self.tier.delete(stored)
        return {k: _sig(v) if isinstance(v, float) else v for k, v in row.items()}

    def baseline(self, stored):
        """The plain path for the stored objects' payload bytes (everything after the
        header) into the same caller buffer (``self.out``; a prefix of it for lz4 objects).
        Returns ``(fn, cold)`` where ``cold`` is ``(drop_page_cache, fn)`` for disk."""
        import torch

        from tiers.format import parse_header

        name, tier = self.name, self.tier
        objs = [bytes(tier.get(k)) for k in stored]
        starts = [parse_header(o).header_end for o in objs]
        sizes = [len(o) - s for o, s in zip(objs, starts, strict=False)]
        dst = self.out.view(torch.uint8).view(-1)
        dst_mv = memoryview(dst.numpy())
        if name == "host":
            srcs = [torch.frombuffer(bytearray(o[s:]), dtype=torch.uint8) for o, s in zip(objs, starts, strict=False)]
            return (lambda: [dst[:t.numel()].copy_(t) for t in srcs]), None
        if name == "disk":
            paths = [tier._file(k) for k in stored]

            def read():
                for p, s, n in zip(paths, starts, sizes, strict=False):
                    with open(p, "rb", buffering=0) as fh:
                        fh.seek(s)
                        fh.readinto(dst_mv[:n])

            def drop():
                for p in paths:
                    fd = os.open(p, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
            return read, (drop, read)
        if name == "redis":
            client, rkeys = tier._client, [tier._rkey(k) for k in stored]

            def get():
                for rk, s, n in zip(rkeys, starts, sizes, strict=False):
                    dst_mv[:n] = memoryview(client.get(rk))[s:]
            return get, None
        if name == "s3":
            client, bucket, okeys = tier._client, tier.bucket, [tier._okey(k) for k in stored]

            def get():
                for ok, s, n in zip(okeys, starts, sizes, strict=False):
                    dst_mv[:n] = memoryview(client.get_object(Bucket=bucket, Key=ok)["Body"].read())[s:]
            return get, None
        raise ValueError(name)


def _variant(key, tag: str):
    from tiers.keys import ChunkKey

    return ChunkKey(key.namespace, key.kind, key.content[:-len(tag) - 1] + "x" + tag)


def bench_gpu(chunks, out, reps, device) -> dict:
    """GpuTier: get = ``get`` of the pooled tensor + ``copy_`` into the caller buffer;
    baseline = ``copy_`` from a plain tensor on the same device."""
    import torch

    from tiers.gpu import GpuTier

    kv_bytes = out.numel() * out.element_size()
    tier = GpuTier(len(chunks) * kv_bytes, device=device)
    dst = torch.empty_like(out, device=device)
    t0 = time.perf_counter()
    for k, kv in chunks:
        tier.put(k, kv)
    _sync(device)
    put_s = time.perf_counter() - t0
    plain = [kv.to(device) for _, kv in chunks]
    keys = [k for k, _ in chunks]
    rng = random.Random(0)

    def ours():
        for k in keys:
            dst.copy_(tier.get(k))
        _sync(device)

    def base():
        for t in plain:
            dst.copy_(t)
        _sync(device)

    def layers():
        for k in keys:
            for _ in range(4):
                i = rng.randrange(NUM_LAYERS)
                dst[i].copy_(tier.get_layer(k, i))
        _sync(device)

    get_s = base_s = float("inf")
    for _ in range(3 * reps):  # cheap: more passes, interleaved
        get_s = min(get_s, _best(ours, 1))
        base_s = min(base_s, _best(base, 1))
    total = kv_bytes * len(keys)
    row = {"get_gbps": _gbps(total, get_s), "put_gbps": _gbps(total, put_s),
           "baseline_gbps": _gbps(total, base_s),
           "layer_get_gbps": _gbps(4 * len(keys) * kv_bytes // NUM_LAYERS, _best(layers, reps)),
           "device": str(device)}
    row["ratio"] = row["get_gbps"] / row["baseline_gbps"]
    return {k: _sig(v) if isinstance(v, float) else v for k, v in row.items()}


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    console = Console()
    wanted = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in ALL_TIERS]
    if unknown:
        raise ValueError(f"--tiers: unknown {unknown}; choose from {ALL_TIERS}")
    num_chunks = args.chunks or (2 if args.quick else 6)
    reps = args.reps or (3 if args.quick else 5)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Copies are memory-bound; on a shared 2-core box OpenMP threads spin against other
    # processes and made copy_ timings erratic (measured: 0.07-6 GB/s for the same copy).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args, console, wanted, num_chunks, reps, device, threads)
    finally:
        torch.set_num_threads(threads)


def _run(args, console, wanted, num_chunks, reps, device, threads) -> int:
    import secrets

    import torch
    from rich.table import Table

    from tiers import auth
    from tiers.keys import Namespace, segment_key

    log = console.print
    started = time.perf_counter()
    shape = (NUM_LAYERS, 2, NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM)
    numel = NUM_LAYERS * 2 * NUM_TOKENS * NUM_KV_HEADS * HEAD_DIM
    flat, source = real_kv_values(args.model, numel, log)
    log(f"[dim]KV source ready: {time.perf_counter() - started:.1f} s")
    ns = Namespace("bench-7b", "0" * 16, "bfloat16", NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM).digest()
    chunks = []
    for i in range(num_chunks):  # distinct chunks: the real values rolled by a different offset
        kv = torch.roll(flat, shifts=i * 7919 * HEAD_DIM).view(shape).contiguous()
        chunks.append((segment_key(ns, [i, 1, 2, 3]), kv))
    out = torch.empty(shape, dtype=torch.bfloat16)
    result = {"shape": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                        "num_tokens": NUM_TOKENS, "dtype": "bfloat16", "chunk_bytes": out.numel() * 2,
                        "layer_bytes": out.numel() * 2 // NUM_LAYERS},
              "kv_source": source, "chunks": num_chunks, "reps": reps, "quick": bool(args.quick),
              "checksums": True, "torch_threads": 1, "torch_threads_default": threads, "disk_page_cache": "warm (get/baseline); *_cold: dropped per read with posix_fadvise for both",
              "tiers": {}}
    rng = random.Random(0)
    defaults = {"host": "none", "disk": "lz4", "redis": "lz4", "s3": "lz4", "gpu": "none"}

    with contextlib.ExitStack() as stack:
        for name in wanted:
            t0 = time.perf_counter()
            if name == "gpu":
                result["tiers"]["gpu"] = {**bench_gpu(chunks, out, reps, device), "default_compression": "none"}
                continue
            tier = _make_tier(name, args, stack, num_chunks, out.numel() * 2)
            bench = _Bench(name, tier, chunks, out, reps, rng)
            row = {"lz4_off": bench.run(False), "lz4_on": bench.run(True)}
            default = row["lz4_on" if defaults[name] == "lz4" else "lz4_off"]
            result["tiers"][name] = {**{k: v for k, v in default.items()}, "default_compression": defaults[name], **row}
            if args.object_key:  # the same bench, objects encoded and read under a key
                with auth.using(auth.ObjectAuth(secrets.token_bytes(32))):
                    signed = bench.run(defaults[name] == "lz4")
                result["tiers"][name]["auth"] = signed
                result["tiers"][name]["auth_get_ratio"] = _sig(signed["get_gbps"] / default["get_gbps"])
                result["tiers"][name]["auth_put_ratio"] = _sig(signed["put_gbps"] / default["put_gbps"])
            close = getattr(tier, "close", None)
            if close is not None:
                close()
            log(f"[dim]{name}: {time.perf_counter() - t0:.1f} s")
    result["lz4"] = lz4_numbers(flat, reps)
    result["seconds"] = round(time.perf_counter() - started, 1)

    table = Table(title=f"kvblend bench tiers — 7B-shaped chunks (32 MiB), {num_chunks} chunks x {reps} passes, best pass")
    for col in ("tier", "lz4", "get GB/s", "baseline GB/s", "ratio", "layer GB/s", "put GB/s", "stored MiB"):
        table.add_column(col, justify="right")
    for name, row in result["tiers"].items():
        variants = [("off", row["lz4_off"]), ("on", row["lz4_on"])] if "lz4_off" in row else [("-", row)]
        for label, r in variants:
            mark = " *" if (label == "on") == (row.get("default_compression") == "lz4") or label == "-" else ""
            table.add_row(name, label + mark, f"{r['get_gbps']:.2f}", f"{r['baseline_gbps']:.2f}",
                          f"{r['ratio']:.2f}", f"{r['layer_get_gbps']:.2f}", f"{r['put_gbps']:.2f}",
                          f"{r.get('stored_bytes_per_chunk', out.numel() * 2) / 2**20:.1f}")
    console.print(table)
    for name, row in result["tiers"].items():
        if "auth" in row:
            console.print(f"{name} with an object key: get {row['auth']['get_gbps']:.2f} GB/s "
                          f"({row['auth_get_ratio']:.2f}x of unsigned), put {row['auth']['put_gbps']:.2f} GB/s "
                          f"({row['auth_put_ratio']:.2f}x)")
    console.print("* = the tier's default setting (lz4 below memory). "
                  f"KV: {source}. Disk page cache warm; cold numbers in the JSON.")
    lz = Table(title="lz4 per 1 MiB layer")
    for col in ("data", "ratio", "decompress GB/s", "compress GB/s"):
        lz.add_column(col, justify="right")
    for name, r in result["lz4"].items():
        lz.add_row(name, f"{r['ratio']:.3f}", f"{r['decompress_gbps']:.2f}", f"{r['compress_gbps']:.2f}")
    console.print(lz)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        console.print(f"wrote {args.json} ({result['seconds']} s)")
    return 0


def _make_tier(name, args, stack: contextlib.ExitStack, num_chunks: int, chunk_bytes: int):
    capacity = (num_chunks + 2) * (chunk_bytes + (1 << 20))
    if name == "host":
        from tiers.host import HostTier
        return HostTier(capacity)
    if name == "disk":
        from tiers.disk import DiskTier
        path = args.disk_path or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvblend-bench-"))
        return DiskTier(path, capacity)
    if name == "redis":
        from cluster.workloads.services import start_redis_process
        from tiers.redis_tier import RedisTier
        if args.redis_url:  # TLS files as every kvblend process gets them: from the config
            from cluster.config import load_config
            values = vars(load_config(overrides={"redis_url": args.redis_url}).tiers)
        else:
            server = stack.enter_context(start_redis_process(tls=getattr(args, "redis_tls", False)))
            values = server.config_values()
        tls = {f"tls_{part}_file": values.get(f"redis_tls_{part}_file", "") for part in ("ca", "cert", "key")}
        return RedisTier(values["redis_url"], timeout_s=30.0, key_prefix="kvblend-bench:", **tls)
    if name == "s3":
        from cluster.workloads.services import start_s3
        from tiers.s3 import S3Tier
        if args.s3_url:
            return S3Tier(args.s3_url, endpoint_url=args.s3_endpoint_url or None, timeout_s=60.0)
        endpoint, bucket = stack.enter_context(start_s3())
        return S3Tier(f"s3://{bucket}/bench", endpoint_url=endpoint, region="us-east-1", timeout_s=60.0)
    raise ValueError(name)
