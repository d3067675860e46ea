"""Fixtures for tests/tiers: the backing services, small KV factories, one factory per tier."""

from __future__ import annotations

import uuid

import pytest
import torch
from services import redis_server, redis_url, s3_endpoint  # noqa: F401  (session fixtures)

from cluster.client_api import encode_kv
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


@pytest.fixture
def make_tier(tmp_path, request):
    """``make_tier(kind, **kwargs)`` -> a fresh, empty byte tier of that kind."""
    made = []

    def factory(kind: str, capacity_bytes: int = 1 << 24, **kwargs):
        if kind == "host":
            from tiers.host import HostTier
            tier = HostTier(capacity_bytes, **kwargs)
        elif kind == "disk":
            from tiers.disk import DiskTier
            tier = DiskTier(str(tmp_path / f"disk-{uuid.uuid4().hex[:6]}"), capacity_bytes,
                            fsync=False, **kwargs)
        elif kind == "redis":
            from tiers.redis_tier import RedisTier
            tier = RedisTier(request.getfixturevalue("redis_url"), key_prefix=f"t{uuid.uuid4().hex[:8]}:", timeout_s=2.0, **kwargs)
        elif kind == "s3":
            from tiers.s3 import S3Tier
            endpoint, bucket = request.getfixturevalue("s3_endpoint")
            tier = S3Tier(f"s3://{bucket}/t{uuid.uuid4().hex[:8]}", endpoint_url=endpoint,
                          region="us-east-1", timeout_s=5.0, max_attempts=2, **kwargs)
        else:
            raise ValueError(kind)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        close = getattr(tier, "close", None)
        if close is not None:
            close()
