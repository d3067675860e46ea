"""The KV tensor codec: a chunk's ``[L, 2, T, H, D]`` torch tensor to and from chunk bytes.

:func:`encode_kv` lays a KV tensor out as one chunk object (:mod:`tiers.format`: header, then
layer by layer); :func:`layer_tensor` views one decoded layer's bytes as a ``[2, T, H, D]``
tensor. Axis letters: L layers, T tokens, H KV heads, D head dim. The tensor dtypes a chunk may
hold are those of :data:`TORCH_DTYPES` (the header's ``dtype`` names them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiers.format import encode_chunk
from tiers.keys import ChunkKey

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class LayerBatch(list):
    """One layer of a request's cached chunks: a list of ``[2, T_i, H, D]`` tensors (or None for a
    chunk that could not be read), plus what a staging source knows about them.

    Attributes:
        ready: a ``torch.cuda.Event`` recorded after the host-to-device copy; the consumer's
            stream waits on it (``Stream.wait_event``) before reading. None: usable now.

    A plain ``list`` is a valid result of ``blend.protocols.KVSource.fetch_layers`` too.
    """

    ready: object | None = None


def encode_kv(key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None,
              compress: bool = False) -> bytes:
    """Encode ``kv`` ``[L, 2, T, H, D]`` into a chunk object (see :mod:`tiers.format`)."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [L, 2, T, H, D], got {tuple(kv.shape)}")
    if kv.dtype not in DTYPE_NAMES:
        raise ValueError(f"kv dtype {kv.dtype} not supported")
    kv = kv.detach().to("cpu").contiguous()
    num_layers, _, num_tokens, num_kv_heads, head_dim = kv.shape
    raw = kv.view(torch.uint8).view(num_layers, -1).numpy()
    return encode_chunk(key, [raw[i] for i in range(num_layers)], dtype=DTYPE_NAMES[kv.dtype],
                        num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        positions=positions, compress=compress)


def layer_tensor(raw: memoryview | bytes, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """View decoded layer bytes as a ``[2, T, H, D]`` tensor (copying a read-only buffer)."""
    mv = memoryview(raw)
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    return torch.frombuffer(mv, dtype=torch.uint8).view(TORCH_DTYPES[dtype]).view(shape)
