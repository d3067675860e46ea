"""A cheap, stable fingerprint of a model checkpoint folder (part of every namespace).

Hashes ``config.json``, the JSON header of every ``*.safetensors`` file (names, dtypes,
shapes, offsets of every tensor) and a few sampled 4 KiB byte ranges of each weight file
(start, middle, end): a few MB read at most, never the gigabytes of weights, so processes
that hold no weights (the vLLM scheduler, ``kvblend ingest``, ``kvblend clear``) compute the
same value as the workers. Two checkpoints that differ anywhere in their tensors' layout or
in the sampled bytes get different fingerprints; a fine-tune that changes only unsampled
bytes would not — the model id and any LoRA name are in the namespace too.
"""

from __future__ import annotations

import hashlib
import os
import struct

_SAMPLE_BYTES = 4096
_SAMPLES = 3


def fingerprint_checkpoint(path: str) -> str:
    """16 hex chars identifying the checkpoint at ``path`` (a HF model folder).

    Raises:
        ValueError: ``path`` is not a directory or has no ``config.json``.
    """
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a directory")
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        raise ValueError(f"model path {path!r} has no config.json")
    h = hashlib.blake2b(digest_size=8, person=b"kvblend-ckpt")
    with open(config, "rb") as fh:
        h.update(fh.read())
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not (name.endswith((".safetensors", ".bin", ".gguf", ".pt"))) or not os.path.isfile(full):
            continue
        size = os.path.getsize(full)
        h.update(name.encode() + struct.pack("<Q", size))
        with open(full, "rb") as fh:
            if name.endswith(".safetensors"):
                (header_len,) = struct.unpack("<Q", fh.read(8))
                h.update(fh.read(min(header_len, 1 << 26)))
            for i in range(_SAMPLES):
                fh.seek(max(0, (size - _SAMPLE_BYTES) * i // max(1, _SAMPLES - 1)))
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()
