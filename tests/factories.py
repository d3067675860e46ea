"""Factories for every test package: keys, KV tensors, chunk objects, tiny models, plans.

Small and keyword-driven; each keeps the seeds and shapes its tests were written against.

* Keys and KV (:func:`make_key`, :func:`make_kv`, :func:`shard_kv`, :func:`make_object`):
  deterministic per seed. Axis letters: L layers, T tokens, H KV heads, D head dim.
* Tiny random-weight HF models (:func:`tiny_model`, :func:`tiny_adapter`, :func:`ops_adapter`)
  and the prompts, chunks and plans fed to them (:func:`random_chunks`, :func:`blend_prompt`,
  :func:`plan_for`, :func:`all_hit_plan`, :func:`store_chunks`, :func:`fill_tiers`).

Imports only ``tiers`` at module level (the tiers tests use this module and import nothing
from ``blend`` or ``cluster``); the model factories import ``blend`` and ``transformers`` when
called.

Tolerances (float32, :data:`F32_TOL`): full prefill through the engine and HF's own forward
differ only by the order of floating-point sums inside the attention/matmul kernels, ~1e-6
relative; we allow ``rtol=1e-4, atol=1e-4`` for KV and logits of tiny models (values O(1),
4 layers).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import TYPE_CHECKING

import torch

from tiers.codec import encode_kv
from tiers.format import rewrite_header
from tiers.keys import ChunkKey, Namespace, prefix_keys, segment_key

if TYPE_CHECKING:
    from blend.adapters.hf import HFModelAdapter
    from blend.plan import BlendPlan

#: The namespace (16 hex digits) of every key these factories make unless told otherwise.
NAMESPACE = "0123456789abcdef"
F32_TOL = dict(rtol=1e-4, atol=1e-4)
BYTE_TIERS = ("host", "disk", "redis", "s3")


# --- keys, KV tensors, chunk objects -------------------------------------------------------

def make_namespace(model_id: str = "tiny", num_layers: int = 3, num_kv_heads: int = 2,
                   head_dim: int = 4, dtype: str = "bfloat16") -> str:
    """The digest of a :class:`tiers.keys.Namespace` (a model other than ``NAMESPACE``'s)."""
    return Namespace(model_id, "f" * 16, dtype, num_layers, num_kv_heads, head_dim).digest()


def make_key(seed: int = 0, namespace: str = NAMESPACE) -> ChunkKey:
    """The segment key of the tokens ``[seed, seed + 1, seed + 2]``."""
    return segment_key(namespace, [seed, seed + 1, seed + 2])


def make_prefix_key(seed: int = 0, namespace: str = NAMESPACE) -> ChunkKey:
    """The first prefix-chunk key of the tokens ``[seed, seed + 1, seed + 2]`` (a chunk whose
    KV may sit at any positions; a segment's is canonical, ``0..T-1``)."""
    return prefix_keys(namespace, [seed, seed + 1, seed + 2], 3)[0]


def make_kv(seed: int = 0, *, num_layers: int = 3, num_tokens: int = 8, num_kv_heads: int = 2,
            head_dim: int = 4, dtype: torch.dtype = torch.bfloat16,
            compressible: bool = False) -> torch.Tensor:
    """Random KV ``[L, 2, T, H, D]``, deterministic per seed; ``compressible`` gives small
    integers (lz4 shrinks them)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_tokens, num_kv_heads, head_dim)
    if compressible:
        return torch.randint(-2, 3, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


#: The KV the Ray cache tests store: ``[4, 2, 16, 2, 8]`` bf16 (4 KiB) unless overridden,
#: sized against their 4 MiB host tier.
shard_kv = functools.partial(make_kv, num_layers=4, num_tokens=16, head_dim=8)


def make_object(key: ChunkKey, kv: torch.Tensor, compress: bool = False, positions=None) -> bytes:
    """The chunk object of ``kv`` ``[L, 2, T, H, D]`` (lz4 layers where they shrink with
    ``compress``)."""
    return encode_kv(key, kv, positions, compress=compress)


def layer_buffers(kv: torch.Tensor) -> list[bytearray]:
    """One zeroed buffer per layer of ``kv``, each the size of a ``[2, T, H, D]`` layer."""
    return [bytearray(kv[0].numel() * kv.element_size()) for _ in range(kv.shape[0])]


def as_layer(buf, like: torch.Tensor) -> torch.Tensor:
    """View raw layer bytes as ``like``'s ``[2, T, H, D]`` shape and dtype."""
    return torch.frombuffer(buf, dtype=torch.uint8).view(like.dtype).view(like.shape)


# --- tiny models ---------------------------------------------------------------------------

def tiny_model(model_type: str = "llama", *, num_layers: int = 4, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, vocab: int = 128, max_position: int = 1024,
               rope_parameters: dict | None = None, seed: int = 0, **extra):
    """A random-weight causal LM of ``model_type`` (float32, eval mode, on the CPU)."""
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    cfg_cls, model_cls = (getattr(transformers, n) for n in classes[model_type])
    params = {"rope_type": "default", "rope_theta": 10000.0, **(rope_parameters or {})}
    config = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=num_layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, max_position_embeddings=max_position,
                     rope_parameters=params, tie_word_embeddings=False, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Larger-than-default weights so that attention is far from uniform and K deviations
    # between cached and blended KV are substantial (random init at std 0.02 is nearly inert).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
    return model


def tiny_adapter(model_type: str = "llama", **kw) -> HFModelAdapter:
    """:func:`tiny_model` behind the HF adapter (model id ``tiny-<model_type>``)."""
    from blend.adapters.hf import HFModelAdapter

    return HFModelAdapter(tiny_model(model_type, **kw), model_id=f"tiny-{model_type}")


def ops_adapter(device="cpu", *, dtype: torch.dtype = torch.float32, **kw) -> HFModelAdapter:
    """A tiny Llama (positions up to 4096) on ``device`` whose K re-rotation is
    :func:`blend.ops.rerotate_k_` (as integrated), for the ops and staging tests."""
    from blend import ops
    from blend.adapters.hf import HFModelAdapter

    class OpsAdapter(HFModelAdapter):
        def rotate_k(self, k, from_positions, to_positions):
            return ops.rerotate_k_(k.clone(), from_positions, to_positions,
                                   self._inv_freq.to(k.device))

    model = tiny_model("llama", max_position=4096, **kw)
    return OpsAdapter(model.to(device=device, dtype=dtype), model_id="tiny-llama")


# --- chunks, prompts, plans ----------------------------------------------------------------

def random_chunks(num: int, length: int, vocab: int = 128, seed: int = 1, low: int = 10):
    """``num`` chunks of ``length`` token ids drawn from ``[low, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (length,), generator=g).tolist() for _ in range(num)]


def blend_prompt(prefix, chunks, query, sep=(7, 8)):
    """Token ids and spans of ``prefix sep c1 sep c2 ... sep query`` (ids, not text)."""
    ids, spans = [], []

    def add(kind, piece):
        if piece:
            spans.append((kind, len(ids), len(ids) + len(piece)))
            ids.extend(piece)

    add("prefix", list(prefix))
    for c in chunks:
        add("sep", list(sep))
        add("chunk", list(c))
    add("sep", list(sep))
    add("query", list(query))
    return ids, spans


def plan_for(ids, spans, client, *, ratio=0.15, check_layers=(1,), min_tokens=0,
             query_to_engine=True, thresholds=(), selection="k_deviation", probe_layers=(),
             sink_tokens=4, chunk_budget_power=0.0, query_funnel=1.0, rank_fusion=0) -> BlendPlan:
    """The planner's plan for ``ids``/``spans`` (keys under :data:`NAMESPACE`), looked up in
    ``client``."""
    from blend.config import BlendConfig
    from blend.planner import make_plan

    config = BlendConfig(check_layers=tuple(check_layers), recompute_ratios=(ratio,),
                         recompute_thresholds=tuple(thresholds), min_tokens=min_tokens,
                         selection=selection, probe_layers=tuple(probe_layers), sink_tokens=sink_tokens,
                         chunk_budget_power=chunk_budget_power, query_funnel=query_funnel,
                         rank_fusion=rank_fusion)
    return make_plan(ids, spans, NAMESPACE, client, config, query_to_engine=query_to_engine)


def all_hit_plan(chunks: list[list[int]], ratio: float, *, prefix=(1, 2, 3), query=(5, 6, 7, 8),
                 sep: int = 3, check_layer: int = 1) -> BlendPlan:
    """``| prefix | sep | chunk 1 | ... | sep | query |`` with every chunk a canonical hit
    (built directly, no planner or lookup)."""
    from blend.plan import CHUNK, PREFIX, QUERY, SEPARATOR, BlendPlan, Segment

    ids = list(prefix)
    segments = [Segment(PREFIX, 0, len(ids))]
    for chunk in chunks:
        segments.append(Segment(SEPARATOR, len(ids), len(ids) + 1))
        ids.append(sep)
        segments.append(Segment(CHUNK, len(ids), len(ids) + len(chunk), key=segment_key(NAMESPACE, chunk),
                                hit=True, stored_positions=tuple(range(len(chunk)))))
        ids.extend(chunk)
    segments.append(Segment(SEPARATOR, len(ids), len(ids) + 1))
    ids.append(sep)
    segments.append(Segment(QUERY, len(ids), len(ids) + len(query)))
    ids.extend(query)
    return BlendPlan(tuple(ids), tuple(segments), check_layers=(check_layer,), recompute_ratios=(ratio,),
                     blend_end=len(ids))


def store_chunks(engine, client, chunks) -> None:
    """Compute and ``client.put`` each chunk's canonical KV (the chunk alone at 0..n-1)."""
    for ids in chunks:
        kv = torch.stack(engine.prefill(ids, want_logits=False).kv)  # [L, 2, T, H, D]
        client.put(segment_key(NAMESPACE, ids), kv)


def fill_tiers(engine, chunks, tiers_with_objects=(), gpu_tiers=()) -> dict[ChunkKey, torch.Tensor]:
    """Compute each chunk's canonical KV; put objects into byte tiers, tensors into gpu tiers."""
    out = {}
    for ids in chunks:
        key = segment_key(NAMESPACE, ids)
        kv = torch.stack(engine.prefill(ids, want_logits=False).kv)  # [L, 2, T, H, D]
        out[key] = kv
        obj = make_object(key, kv)
        for tier in tiers_with_objects:
            assert tier.put(key, obj)
        for tier in gpu_tiers:
            assert tier.put(key, kv)
    return out


#: a chunk object with header fields replaced, all else consistent (tests of forged headers)
forge_header = rewrite_header


#: seconds a call under test may take before it counts as a hang (a guard, not a timing assert)
HANG_S = 10.0


class FakeClock:
    """A ``time.monotonic`` stand-in a test moves by hand (``clock.now += 5``)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def returns_within(fn, *args, hang_s: float = HANG_S, what: str = ""):
    """``fn(*args)``'s result, failing the test when it does not return within ``hang_s``
    (``what`` names the hang in the message); an exception it raises is re-raised here."""
    import threading

    out, err = [], []

    def run():
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(hang_s)
    assert not t.is_alive(), what or f"{getattr(fn, '__name__', fn)} blocked (> {hang_s} s)"
    if err:
        raise err[0]
    return out[0] if out else None


def wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    """Return once process ``pid`` has exited (``ray.kill`` only asks an actor to die); a
    hang guard: ``psutil.TimeoutExpired`` after ``timeout_s`` seconds."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(timeout=timeout_s)


#: Object keys (tiers.auth) of the authentication tests: two, to sign under one and read under the other.
OBJECT_KEY_A = "kvblend-test-object-key-A-0123456789"
OBJECT_KEY_B = "kvblend-test-object-key-B-0123456789"


@contextlib.contextmanager
def object_keys():
    """Yields ``use(key)``: this process signs and checks chunk objects under ``key`` (a str;
    None: no key) from then on; the authenticator from before is restored on exit."""
    from tiers import auth

    with auth.using(auth.current()):
        yield lambda key: auth.configure(None if key is None else auth.ObjectAuth(key.encode()))


@contextlib.contextmanager
def redis_shards(cluster_address: str, root, env_vars: dict | None = None, **overrides):
    """Shards (one per node of the test Ray cluster at ``cluster_address``) over a fresh
    redis-server, no disk tier, in a namespace of their own; yields ``(config, shard names,
    redis process)`` and stops both on exit. ``env_vars``: the shards' environment."""
    import uuid

    from cluster.cache.lifecycle import start_shards, stop_shards
    from cluster.config import load_config
    from cluster.workloads.services import start_redis_process

    with start_redis_process() as redis:
        cfg = load_config(environ={}, overrides={
            "ray_address": cluster_address, "ray_namespace": f"kvblend-redis-{uuid.uuid4().hex[:6]}",
            "cache_dir": str(root), "host_size_gib": 0.004, "disk_size_gib": 0.0,
            "redis_url": redis.url, "io_timeout_s": 0.5, "call_timeout_s": 10.0, "load_timeout_s": 10.0,
            **overrides})
        try:
            yield cfg, start_shards(cfg, env_vars=env_vars), redis
        finally:
            stop_shards(cfg.cluster.ray_namespace)


def ray_free_shard(monkeypatch, tmp_path, cfg):
    """A real :class:`cluster.cache.shard.CacheShard` without Ray: the runtime context, the
    stats publisher and ``ray.put`` (``_store_host`` keeps a string ref) are stand-ins; the
    host tier, promotion, ``get_refs``, ``put`` and ``lookup`` run as in the actor. Callers set
    ``lower_stack``/``lower`` and shut its pools down (:func:`stop_shard`)."""
    from types import SimpleNamespace

    import ray

    from cluster.cache import shard as shard_mod

    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-0"))
    monkeypatch.setattr(shard_mod.CacheShard, "_publish_loop", lambda self: None)
    s = shard_mod.CacheShard("shard-test", cfg, str(tmp_path), metrics=False)

    def store_host(key, obj, header_end):
        ref = f"ref:{key}"
        return ref if s.host.put_object(key, (ref, bytes(obj[:header_end]), len(obj)), len(obj)) else None

    s._store_host = store_host
    return s


def ray_free_client(monkeypatch, cfg, router=None):
    """A real :class:`cluster.cache.client.CacheClient` over a real
    :class:`~cluster.cache.ray_transport.RayTransport` without Ray: the connection, the shard
    router (``router``, else one with no shards) and the writer are stand-ins; headers, objects
    and reads are the real ones. The caller closes it."""
    from cluster.cache import client as client_mod
    from cluster.cache import ray_transport

    class NoShards:
        def __init__(self, *args) -> None:
            pass

        def refresh(self, force: bool = False) -> None:
            pass

        def groups(self, keys):
            return {}

        def call(self, groups, method, args_for, timeout_s=None, late=None):
            return {}

    monkeypatch.setattr(ray_transport, "connect", lambda cluster: object())
    monkeypatch.setattr(ray_transport, "ShardRouter", lambda *args: router or NoShards())
    monkeypatch.setattr(ray_transport, "ShardWriter", lambda router, count: None)
    return client_mod.CacheClient(cfg)


def stop_shard(s) -> None:
    """Shut down the pools of a :func:`ray_free_shard` and release its disk lock."""
    pool = getattr(s, "_pool", None)
    if pool is not None:
        pool.shutdown(wait=True)
    if getattr(s, "writes", None) is not None:  # the write-downs' pool
        s.writes.close()
    if getattr(s, "_lower_lookup", None) is not None:  # the lookups' header-read pool
        s._lower_lookup.close()
    if getattr(s, "_disk_lock", None) is not None:  # its disk directory's flock
        os.close(s._disk_lock)
        s._disk_lock = None


def sibling_client(client):
    """Another client over the same store as ``client`` (another replica's: nothing looked up,
    nothing held): over its shards from this process or through an agent of its own; over the
    same tier for a local one (that tier stays ``client``'s to close). The caller closes it."""
    from cluster.cache.client import CacheClient
    from cluster.cache.factory import agent_client

    first = client.transports[0]
    if first.name == "ray":
        return CacheClient(client.config, client.namespace)
    if first.name == "agent":
        return agent_client(client.config, client.namespace)
    return CacheClient(None, transports=client.transports, borrowed=client.transports)
