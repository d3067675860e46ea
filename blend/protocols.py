"""What the blend engine needs from the outside, as protocols that ``cluster`` implements.

Axis letters used in shapes throughout ``blend``::

    T  tokens of the prompt (or of one chunk)      H  KV heads        Hq  query heads
    D  head dim        E  hidden size              L  decoder layers  V   vocab size

* :class:`KVSource` — where cached chunk KV comes from (the vLLM worker's source: its gpu tier
  in front of the cluster client, staged through pinned memory on CUDA; an in-memory dict in
  tests). Reads are batch-first and per layer; the engine asks for every layer it will need
  at once, when a request starts, so the source can move them while the engine computes.
* :class:`BlendModel` — the model, cut at the seams CacheBlend needs (per-layer qkv with
  RoPE, attention done by the engine, then the rest of the layer). Implemented by the
  HF-transformers adapter (:mod:`blend.adapters.hf`) and the vLLM adapter
  (:mod:`blend.adapters.vllm`), spiked against vLLM 0.32's ``LlamaDecoderLayer``
  (``input_layernorm`` → ``self_attn.qkv_proj`` (fused) → ``rotary_emb`` → ``attn`` →
  ``o_proj`` → ``post_attention_layernorm`` → ``mlp``) and HF's ``LlamaDecoderLayer``
  (separate ``q_proj``/``k_proj``/``v_proj``, ``rotary_emb`` on the model).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tiers.codec import LayerBatch
from tiers.keys import ChunkKey

__all__ = ["BlendModel", "ChunkMeta", "KVSink", "KVSource", "LayerBatch", "ModelSpec", "fetch_each",
           "fetch_in_order"]

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ChunkMeta:
    """What a lookup learns about a stored chunk without reading its layers."""

    key: ChunkKey
    num_tokens: int
    positions: tuple[int, ...]  # positions the stored K was rotated at (canonical: 0..T-1)
    tier: str                   # tier that answered (gpu, host, disk, redis, s3)


@runtime_checkable
class KVSource(Protocol):
    """Cached KV of chunks, per layer.

    Lifecycle (one request): ``lookup`` once with all segment keys (starts promotion /
    prefetch of the hits), then ``fetch_layers`` once with every layer the request needs
    (ascending); the engine takes the futures' results in that order, one per layer it
    computes, so a source moves layer ``l+1`` while layer ``l`` is computed (CacheBlend,
    Yao et al., EuroSys 2025, §5) with no per-layer call on the engine's thread. The engine
    cancels the futures it no longer needs (a fallback, an abandoned request); a source
    stops its work for them.

    Failure behaviour: never raises for cache faults. ``lookup`` reports a dead tier or shard
    as a miss; a future resolves to ``None`` in the slot of a chunk that could not be read
    (truncated, corrupted, shard died since lookup), and the caller recomputes.
    """

    def lookup(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        """Which keys are cached (one round trip for the batch). Starts prefetch of hits."""
        ...

    def fetch_layers(self, keys: Sequence[ChunkKey],
                     layer_idxs: Sequence[int]) -> list[Future[list[torch.Tensor | None]]]:
        """One future per entry of ``layer_idxs``: that layer of each chunk, as ``[2, T_i, H, D]``
        tensors (K then V, K rotated at the chunk's stored positions) on the engine's device
        and KV dtype, a plain list or a :class:`~tiers.codec.LayerBatch`.

        Raises:
            ValueError: a negative layer index (at the call, not through a future).
        """
        ...


def fetch_in_order(submit, read, keys: Sequence[ChunkKey],
                   layer_idxs: Sequence[int]) -> list[Future[list[torch.Tensor | None]]]:
    """``fetch_layers`` for a source with a thread pool: one task (``submit(fn)``) reads
    ``read(keys, l)`` for each layer in order and resolves its future (a cancelled one is
    skipped). ``read`` must not raise (a fault is a list of None). One task, not one per
    layer: per-layer tasks on several threads contend for the GIL (measured on the Ray
    client, ``kvblend bench cluster``: client ratio 0.24-0.31 against 0.48 in order)."""
    keys, layer_idxs = list(keys), list(layer_idxs)
    if any(i < 0 for i in layer_idxs):
        raise ValueError(f"layer_idxs {layer_idxs} must be >= 0")
    futs: list[Future] = [Future() for _ in layer_idxs]

    def run() -> None:
        for layer_idx, fut in zip(layer_idxs, futs, strict=True):
            if fut.set_running_or_notify_cancel():
                fut.set_result(read(keys, layer_idx))

    if futs:
        submit(run)
    return futs


def fetch_each(fetch_layer, keys: Sequence[ChunkKey],
               layer_idxs: Sequence[int]) -> list[Future[list[torch.Tensor | None]]]:
    """``fetch_layers`` for a source that reads one layer per call: ``fetch_layer(keys, l)``
    for every ``l`` now (a source with its own threads reads them in the background)."""
    keys = list(keys)
    if any(i < 0 for i in layer_idxs):
        raise ValueError(f"layer_idxs {list(layer_idxs)} must be >= 0")
    return [fetch_layer(keys, i) for i in layer_idxs]


@runtime_checkable
class KVSink(Protocol):
    """Where newly computed canonical chunk KV goes (the cluster client; a dict in tests).

    ``put`` is asynchronous and idempotent and never raises for cache faults; ``flush``
    waits (up to ``timeout_s``) for pending puts and returns whether all finished.
    """

    def put(self, key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None) -> None:
        """Store ``kv`` of shape ``[L, 2, T, H, D]`` (canonical: positions 0..T-1)."""
        ...

    def flush(self, timeout_s: float = 60.0) -> bool:
        ...


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and RoPE parameters of a model, as the engine and the namespace need them."""

    model_id: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...] = ()   # sorted items of the HF rope_scaling dict
    sliding_window: int | None = None
    max_position: int = 0
    dtype: str = "float32"

    @property
    def rope_key(self) -> str:
        return f"theta={self.rope_theta};" + ";".join(f"{k}={v}" for k, v in self.rope_scaling)


@runtime_checkable
class BlendModel(Protocol):
    """A decoder-only transformer cut at CacheBlend's seams.

    All methods work on one sequence (no batch axis) and run without a KV cache of their own:
    the engine keeps the KV. Tensors live on ``self.device`` in ``self.dtype``.

    Shapes:
        token_ids: ``[T]`` int64; positions: ``[T]`` int64.
        hidden, residual: ``[T, E]``.
        q: ``[T, Hq, D]``; k, v: ``[T, H, D]`` (q and k after RoPE at ``positions``).
        attn_out: ``[T, Hq * D]`` (before the output projection).
        logits: ``[T, V]`` float32.
    """

    spec: ModelSpec

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, E]``."""
        ...

    def qkv(self, layer_idx: int, hidden: torch.Tensor, residual: torch.Tensor | None,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm (adding ``residual`` first when given), QKV projection and RoPE.

        Returns ``(q, k, v, residual)`` where ``residual`` is the new residual stream."""
        ...

    def rotate_k(self, k: torch.Tensor, from_positions: torch.Tensor,
                 to_positions: torch.Tensor) -> torch.Tensor:
        """Re-rotate post-RoPE K ``[T, H, D]`` from ``from_positions`` to ``to_positions``
        (a copy). Raises ValueError for RoPE that is not linear in position."""
        ...

    def finish_layer(self, layer_idx: int, attn_out: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, residual add, post-attention norm and MLP.

        Returns ``(hidden, residual)`` for the next layer's :meth:`qkv`."""
        ...

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[T, V]`` float32."""
        ...
