"""``kvblend ingest``: fill the shared cache with the canonical KV of a corpus's passages.

Each passage is tokenized canonically (:func:`blend.segments.chunk_token_ids`: alone, no
BOS), prefilled alone at positions ``0..n-1`` straight through the blend engine's model (not
as a prompt), and stored under its position-independent segment key. Resumable: passages
whose key is already stored are skipped (one batched ``contains`` per batch).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

log = logging.getLogger("kvblend.ingest")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True,
                   help="JSONL corpus: {\"passages\": [...]} rows (id, question and answers optional), "
                        "or one passage per line (a JSON string or {\"text\": ...})")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--model", default=None,
                   help="model as vLLM is given it: bundled name, folder or Hugging Face Hub id found in "
                        "the local HF cache (default: config 'model')")
    p.add_argument("--revision", default=None, help="Hub revision of --model (as vllm serve --revision)")
    p.add_argument("--hf-overrides", default=None,
                   help="JSON object of config overrides, as vllm serve --hf-overrides (must match the "
                        "server's for its requests to hit)")
    p.add_argument("--limit", type=int, default=None, help="read at most this many rows")
    p.add_argument("--ray-address", default=None, help="Ray cluster (default: config ray_address)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="KV dtype; must match the serving engine's --dtype (default: bfloat16 with "
                        "a GPU, float32 on a CPU-only machine)")


@dataclass
class IngestReport:
    passages: int
    stored: int
    skipped: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def unique_passages(rows: Iterable) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for p in row.passages:
            seen.setdefault(p, None)
    return list(seen)


def ingest_passages(passages: Sequence[str], engine, tokenizer, client, namespace_digest: str,
                    *, kv_dtype=None, batch_size: int = 8, progress: bool = True) -> IngestReport:
    """Compute and store the canonical KV of ``passages`` not yet cached.

    Args:
        engine: a :class:`blend.engine.BlendEngine` (its ``prefill`` gives ``[2, T, H, D]`` per layer).
        client: a cache client (``contains``, ``put``, ``flush``).
        kv_dtype: torch dtype of the stored KV (the namespace's ``kv_dtype``; default: the
            engine's compute dtype).

    Returns:
        Counts and time; ``flush`` is called before returning.
    """
    import torch
    from tqdm import tqdm

    from blend.segments import chunk_token_ids
    from tiers.keys import segment_key

    kv_dtype = kv_dtype or engine.model.dtype
    t0 = time.perf_counter()
    stored = skipped = tokens = 0
    bar = tqdm(total=len(passages), desc="ingest", unit="passage", disable=not progress)
    for start in range(0, len(passages), batch_size):
        batch = passages[start:start + batch_size]
        ids = [chunk_token_ids(tokenizer, p) for p in batch]
        keys = [segment_key(namespace_digest, i) for i in ids]
        present = client.contains(keys)
        for key, token_ids, have in zip(keys, ids, present, strict=True):
            if have:
                skipped += 1
            else:
                with torch.inference_mode():
                    result = engine.prefill(token_ids, want_logits=False)
                client.put(key, torch.stack(result.kv).to(kv_dtype))  # [L, 2, T, H, D]
                stored += 1
                tokens += len(token_ids)
            bar.update()
    bar.close()
    client.flush(timeout_s=300.0)
    return IngestReport(len(passages), stored, skipped, tokens, time.perf_counter() - t0)


def build_engine(model_path: str, dtype: str, hf_overrides=None):
    """HF-adapter engine for ingest, and the tokenizer.

    On CPU the model computes in float32 and the KV is cast to ``dtype`` when stored: PyTorch's
    bf16 matmuls on CPUs without AMX ran ~30 tokens/s here, float32 ~1,000 (measured on
    SmolLM2-135M, 2 cores); on a GPU it computes in ``dtype``. ``hf_overrides`` (dict or JSON
    string) is applied to the model's config with vLLM's rules
    (:func:`cluster.namespace.apply_overrides`), so the KV is the served model's.
    """
    import torch
    from transformers import AutoTokenizer

    from blend.adapters.hf import HFModelAdapter
    from blend.engine import BlendEngine
    from cluster.namespace import canonical_overrides, model_id_of

    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    compute = torch_dtype if torch.cuda.is_available() else torch.float32
    overrides, _ = canonical_overrides(hf_overrides)
    if overrides:
        from transformers import AutoConfig, AutoModelForCausalLM

        from cluster.namespace import apply_overrides

        config = apply_overrides(AutoConfig.from_pretrained(model_path), overrides)
        model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=compute,
                                                     attn_implementation="sdpa")
        adapter = HFModelAdapter(model, model_id=model_id_of(model_path))
    else:
        adapter = HFModelAdapter.from_pretrained(model_path, dtype=compute, model_id=model_id_of(model_path))
    return BlendEngine(adapter), AutoTokenizer.from_pretrained(model_path)


def run(args: argparse.Namespace) -> int:
    import torch

    from cluster.cache.factory import make_client
    from cluster.config import cache_dir, load_config
    from cluster.namespace import fingerprint_cache_path, namespace_for
    from cluster.workloads.model import resolve_model
    from cluster.workloads.qa import load_examples

    overrides = {}
    if args.model:
        overrides["model"] = args.model
    if args.ray_address:
        overrides["ray_address"] = args.ray_address
    config = load_config(args.config, overrides=overrides)
    # the corpus first: a malformed row is an error before a model is loaded
    passages = unique_passages(load_examples(args.data, limit=args.limit, questions=False))
    from cluster.workloads.replicas import default_dtype

    args.dtype = args.dtype or default_dtype()
    model_path = resolve_model(config.cluster.model, cache_dir(config), revision=args.revision)
    namespace = namespace_for(model_path, args.dtype, hf_overrides=args.hf_overrides,
                              fingerprint_cache=fingerprint_cache_path(config))
    # the connector logs the same line at start: equal digests mean ingest's chunks are hit
    print(f"namespace {namespace.digest()} (model {namespace.model_id}, dtype {args.dtype}, "
          f"overrides {namespace.overrides or 'none'}, quantization {namespace.quantization or 'none'})",
          flush=True)
    engine, tokenizer = build_engine(model_path, args.dtype, args.hf_overrides)
    client = make_client(config, namespace.digest())
    report = ingest_passages(passages, engine, tokenizer, client, namespace.digest(),
                             kv_dtype=getattr(torch, args.dtype))
    print(f"ingested {report.stored} passages ({report.tokens} tokens) in {report.seconds:.1f} s "
          f"({report.tokens_per_s:.0f} tokens/s); {report.skipped} already cached")
    return 0
