"""Factories for the tiers tests: keys, KV tensors, encoded chunk objects."""

from __future__ import annotations

import torch

from tiers.codec import encode_kv
from tiers.keys import ChunkKey, Namespace, segment_key

BYTE_TIERS = ("host", "disk", "redis", "s3")


def make_namespace(model_id: str = "tiny", num_layers: int = 3, num_kv_heads: int = 2,
                   head_dim: int = 4, dtype: str = "bfloat16") -> str:
    return Namespace(model_id, "f" * 16, dtype, num_layers, num_kv_heads, head_dim).digest()


def make_key(seed: int = 0, namespace: str | None = None) -> ChunkKey:
    return segment_key(namespace or make_namespace(), [seed, seed + 1, seed + 2])


def make_kv(num_layers: int = 3, num_tokens: int = 8, num_kv_heads: int = 2, head_dim: int = 4,
            dtype: torch.dtype = torch.bfloat16, seed: int = 0, compressible: bool = False) -> torch.Tensor:
    """``[L, 2, T, H, D]``; ``compressible`` gives small integers (lz4 shrinks them)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_tokens, num_kv_heads, head_dim)
    if compressible:
        return torch.randint(-2, 3, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def make_object(key: ChunkKey, kv: torch.Tensor, compress: bool = False, positions=None) -> bytes:
    return encode_kv(key, kv, positions, compress=compress)


def layer_buffers(kv: torch.Tensor) -> list[bytearray]:
    return [bytearray(kv[0].numel() * kv.element_size()) for _ in range(kv.shape[0])]


def as_layer(buf, like: torch.Tensor) -> torch.Tensor:
    """View raw layer bytes as ``like``'s ``[2, T, H, D]`` shape and dtype."""
    return torch.frombuffer(buf, dtype=torch.uint8).view(like.dtype).view(like.shape)
