"""How one layer of a request's chunks is gathered into host staging memory, for
:class:`tiers.staging.StagedSource` (its staging thread calls these, one request at a time).

A :class:`LayerGather` holds where the bytes come from (a :class:`tiers.host_layers.HostLayers`)
and the io threads that copy them:

* :meth:`LayerGather.views` — per chunk, zero-copy uint8 views of every layer's checked raw
  bytes, when the reader has them for every hit chunk (a client's mapped objects, a host
  tier's verified ranges); the fill is then one numpy copy per chunk.
* :meth:`LayerGather.copy_views` / :meth:`LayerGather.fill` — a layer into a staging buffer
  from those views, or through ``layer_into`` (disk reads, lz4 decode, checksums), spread over
  the io threads for a big layer (numpy copies without the GIL).
* :meth:`LayerGather.device_readable` — the views as direct copy sources when the copy engine
  reads them (memory registered with CUDA: the cache agent's arena): no staging at all.

Faults are misses: a chunk whose layer could not be read is ``False`` in :meth:`fill`'s answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tiers.direct_copy import Readable
from tiers.keys import ChunkKey

log = logging.getLogger(__name__)

#: a layer below this many bytes is copied by the calling thread alone
PARALLEL_BYTES = 4 << 20


class LayerGather:
    """Gathers a request's layers from ``layers`` (:class:`tiers.host_layers.HostLayers`)
    with ``num_io_threads`` io threads; ``cuda``: whether copies go to a CUDA device (only
    then are views :meth:`device_readable`). :meth:`close` stops the threads."""

    def __init__(self, layers, num_io_threads: int, cuda: bool) -> None:
        self.layers = layers
        self.name = layers.name
        self._cuda = cuda
        self._io = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvblend-stage-io")
        self._num_io = num_io_threads

    def close(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)

    def copy_views(self, pairs: list[tuple[np.ndarray, np.ndarray]], total: int) -> None:
        """``np.copyto(dst, src)`` for each pair, spread over the io threads for a big layer:
        numpy copies without the GIL and without a thread pool of its own (``Tensor.copy_``
        called from several threads each fanned out to every core: 10-14 GB/s on the H200's
        host, measured 2026-12-01), so the threads copy in parallel."""
        if len(pairs) < 2 or total < PARALLEL_BYTES:
            for dst, src in pairs:
                np.copyto(dst, src)
            return

        def run(group):
            for dst, src in group:
                np.copyto(dst, src)
        jobs = [self._io.submit(run, pairs[g::self._num_io]) for g in range(min(self._num_io, len(pairs)))]
        for job in jobs:
            job.result()

    def fill(self, keys: Sequence[ChunkKey], headers, offsets, layer_idx: int, raw: np.ndarray) -> list[bool]:
        """Copy each chunk's layer into ``raw`` at its offset (io threads for big layers)."""
        todo = [i for i, h in enumerate(headers) if h is not None]

        def one(i: int) -> bool:
            h = headers[i]
            return self.layers.layer_into(keys[i], h, layer_idx, raw[offsets[i]:offsets[i] + h.layer_nbytes])

        ok = [False] * len(keys)
        if len(todo) > 1 and raw.nbytes >= PARALLEL_BYTES:
            groups = [todo[g::self._num_io] for g in range(min(self._num_io, len(todo)))]
            jobs = [self._io.submit(lambda idx: [(i, one(i)) for i in idx], g) for g in groups]
            for job in jobs:
                for i, good in job.result():
                    ok[i] = good
        else:
            for i in todo:
                ok[i] = one(i)
        return ok

    def views(self, keys: Sequence[ChunkKey], headers) -> list[list[np.ndarray]] | None:
        """Per chunk, uint8 arrays of every layer's checked raw bytes (``layer_views``), when
        every hit chunk has them; else None (layers are read by ``layer_into``)."""
        get = getattr(self.layers, "layer_views", None)
        if get is None or not any(h is not None for h in headers):
            return None
        out: list[list[np.ndarray]] = []
        for key, h in zip(keys, headers, strict=True):
            if h is None:
                out.append([])
                continue
            try:
                got = get(key, h)
            except Exception as e:  # noqa: BLE001 - no fast path; layer_into decides
                log.debug("%s: no layer views of %s (%s)", self.name, key, e)
                got = None
            if got is None or len(got) != h.num_layers:
                return None
            out.append([np.frombuffer(v, dtype=np.uint8) for v in got])
        return out

    def device_readable(self, keys: Sequence[ChunkKey], headers, views) -> list[Readable | None] | None:
        """Per chunk its ``views`` as direct copy sources when the reader says the copy engine
        reads every hit chunk's views (``views_device_readable``: memory registered with
        CUDA, e.g. the cache agent's arena); else None."""
        check = getattr(self.layers, "views_device_readable", None)
        if not self._cuda or views is None or check is None:
            return None
        hits = [(k, h) for k, h in zip(keys, headers, strict=True) if h is not None]
        if not hits or not all(check(k) for k, _h in hits):
            return None
        return [None if h is None else Readable(v) for h, v in zip(headers, views, strict=True)]
