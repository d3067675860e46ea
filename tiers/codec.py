"""The KV tensor codec: a chunk's ``[L, 2, T, H, D]`` torch tensor to and from chunk bytes.

:func:`encode_kv` lays a KV tensor out as one chunk object (:mod:`tiers.format`: header, then
layer by layer); :func:`layer_tensor` views one decoded layer's bytes as a ``[2, T, H, D]``
tensor; :func:`object_layer` checks, decodes and copies one layer out of a whole chunk object
(what every client does with the objects it holds mapped). Axis letters: L layers, T tokens, H KV heads, D head dim. The tensor dtypes a chunk may
hold are those of :data:`TORCH_DTYPES` (the header's ``dtype`` names them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiers.format import ChunkHeader, decode_layer, encode_chunk
from tiers.keys import ChunkKey

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class LayerBatch(list):
    """One layer of a request's cached chunks: a list of ``[2, T_i, H, D]`` tensors (or None for a
    chunk that could not be read), plus what a staging source knows about them.

    Attributes:
        ready: a ``torch.cuda.Event`` recorded after the host-to-device copy; the consumer's
            stream waits on it (``Stream.wait_event``) before reading. None: usable now.
        busy_s: seconds the source spent moving the request's layers up to and including this
            one (reading them into its staging memory, waiting for a free ring slot), not
            counting its waits for the consumer to take layers; on the last layer, the
            request's transfer as one number (a point sample for the cost estimates, issue 34).
            None: the source does not measure it.

    A plain ``list`` is a valid result of ``blend.protocols.KVSource.fetch_layers`` too.
    """

    ready: object | None = None
    busy_s: float | None = None


def check_kv(kv: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``kv`` is ``[L, 2, T, H, D]`` in a dtype of :data:`TORCH_DTYPES`."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [L, 2, T, H, D], got {tuple(kv.shape)}")
    if kv.dtype not in DTYPE_NAMES:
        raise ValueError(f"kv dtype {kv.dtype} not supported")


def encode_kv(key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None,
              compress: bool = False) -> bytes:
    """Encode ``kv`` ``[L, 2, T, H, D]`` into a chunk object (see :mod:`tiers.format`).

    Raises:
        ValueError: as :func:`check_kv`.
    """
    check_kv(kv)
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


def object_layer(header: ChunkHeader, layer_idx: int, obj, *, checked: bool) -> torch.Tensor:
    """Layer ``layer_idx`` of a whole chunk object, decoded and copied out.

    Args:
        header: ``obj``'s own header (a tier may re-encode a chunk: its offsets are the object's).
        obj: the object's bytes (any buffer: a mapped Ray object, an arena slot, bytes).
        checked: every layer of ``obj`` was checked against ``header`` as it entered host
            memory (a shard's host tier validates each object it stores: ``CacheShard.put``,
            promotions), so neither its XXH3 nor its tag is checked again, as the staging path
            copies such layers (:mod:`cluster.cache.host_layers`); False (objects read from
            disk, Redis or S3, a machine-local tier): the layer's tag when a key is set, else
            its XXH3.

    Returns:
        ``[2, T, H, D]`` in the stored dtype on the CPU, in memory of its own (one copy of a
        raw layer, a decompression and a copy of an lz4 one: the object serves later requests,
        and the engine may write into what it gets).

    Raises:
        FormatError: a length or checksum mismatch, an lz4 stream that does not decode;
        AuthError: a tag that does not match.
    """
    e = header.layers[layer_idx]
    raw = decode_layer(header, layer_idx, memoryview(obj)[e.offset:e.offset + e.stored_len],
                       verify=not checked)
    # copied by bytearray, writable and its own: 16 layers of 256 KiB at 7.7 GB/s on the 2-core
    # dev VM, where torch's clone into its own allocation ran at 1-3 GB/s (page faults; #32)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(TORCH_DTYPES[header.dtype]).view(
        header.layer_shape)
