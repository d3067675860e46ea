"""The fingerprint of a model checkpoint folder: every byte of its files (part of every namespace).

What is hashed: the top-level files that make the KV (symlinks followed, as in a Hugging Face
cache snapshot whose files link to ``blobs/``): ``config.json``, remote code, and the weights
of the format vLLM loads (:func:`checkpoint_files`). Each
file's bytes are hashed whole with BLAKE2b-256; the fingerprint is BLAKE2b-128 over the sorted
``(name, size, file digest)`` triples. Sub-folders are not read: vLLM loads the weights at the
top level of a model folder (a Hub repo's ``original/`` copy is not what it serves).

Why whole files and not samples: the previous fingerprint read 3 x 4 KiB per weight file, so a
fine-tune that rewrote unsampled bytes kept the namespace and served the old KV. Hashing every
byte costs one pass over the checkpoint (0.38 s for the bundled 269 MB SmolLM2 weights file:
~700 MB/s from the page cache on one core of the development machine; a 140 GB checkpoint
~3 min on one core, less with one thread per file) and is paid once per file identity: digests are cached in a small JSON file
(``cache_path``, e.g. ``<kvblend cache_dir>/fingerprints.json``) keyed by the file's
``(st_dev, st_ino)`` and checked against its ``(st_size, st_mtime_ns, st_ctime_ns)``. Rewriting
a file changes its mtime and ctime (ctime cannot be set back from user space, so even ``cp -p``
or ``rsync -t`` over an existing file misses), and replacing it gives a new inode: either way
the entry misses and the file is hashed again.

Why it cannot collide in practice: the encoding of the triples is injective (names end with
NUL, sizes are 8 bytes, digests 32 bytes), so two folders with equal fingerprints need a
BLAKE2b-256 collision of some file (birthday bound 2**128 work) or a BLAKE2b-128 collision of
the triple lists (2**64 work); accidental collisions among even a million checkpoints have
probability ~1e-27. The namespace digest built from it is 64 bits (:meth:`tiers.keys.Namespace.digest`):
among 10**4 namespaces in one cache, ~3e-12.

Concurrency: the scheduler, every worker and ``kvblend ingest`` may fingerprint the same folder
at once. The cache file is only ever replaced whole (temp file + ``os.replace``), so a reader
sees an old or a new version, never a torn one; the hashing of cache misses runs under an
exclusive ``flock`` on ``<cache_path>.lock``, so a checkpoint is hashed by one process while
the others wait and then read its digests. A cache that cannot be read or written is ignored
(the digests are computed and kept in this process only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

#: bytes per read while hashing (1-8 MiB all ran at the same speed here: the hash is the limit)
READ_BYTES = 4 << 20
#: file names not hashed: documents and bookkeeping that do not change the served model
#: (``kvblend-prepared.json`` records how long ``kvblend model prepare`` took)
SKIPPED = ("README.md", "LICENSE", "LICENSE.md", "LICENSE.txt", "NOTICE", "USE_POLICY.md",
           "kvblend-prepared.json")
#: most entries the JSON cache keeps (the oldest are dropped first)
MAX_CACHE_ENTRIES = 4096
_CACHE_VERSION = 1

#: this process's digests by file identity (dev, ino, size, mtime_ns, ctime_ns)
_memo: dict[tuple[int, int, int, int, int], str] = {}
_memo_lock = threading.Lock()


def hash_file(path: str) -> str:
    """Hex BLAKE2b-256 of every byte of the file at ``path`` (read in :data:`READ_BYTES` blocks).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.blake2b(digest_size=32)
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])  # releases the GIL: files hash in parallel threads
    return h.hexdigest()


#: weight formats in vLLM's order of preference: a folder holding safetensors is served from
#: them alone (vLLM skips ``*.bin`` then), else from the first format present
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def checkpoint_files(path: str) -> list[str]:
    """Sorted names of the files of folder ``path`` that the fingerprint covers:
    ``config.json``, remote code (``*.py``) and the weight files of the format vLLM loads
    (:data:`WEIGHT_SUFFIXES`). Tokenizer and generation files are left out: chunk keys are
    token ids, and vLLM may add them to a Hub snapshot after a process fingerprinted it."""
    names = [n for n in os.listdir(path) if not n.startswith(".") and n not in SKIPPED
             and os.path.isfile(os.path.join(path, n))]
    weights: list[str] = []
    for suffix in WEIGHT_SUFFIXES:
        weights = [n for n in names if n.endswith(suffix) and n != "training_args.bin"]
        if weights:
            break
    return sorted({"config.json", *weights, *(n for n in names if n.endswith(".py"))} & set(names))


def fingerprint_checkpoint(path: str, cache_path: str | None = None) -> str:
    """32 hex chars identifying every byte of the checkpoint folder ``path``.

    Args:
        path: a model folder with a ``config.json`` (a HF folder or a Hub cache snapshot).
        cache_path: JSON file caching per-file digests across processes (created if missing;
            ``None``: this process's memory only).

    Raises:
        ValueError: ``path`` is not a directory, has no ``config.json``, or a file of it cannot
            be read (the error names the file).
    """
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model path {path!r} has no config.json")
    names = checkpoint_files(path)
    full = [os.path.join(path, n) for n in names]
    try:
        stats = [os.stat(f) for f in full]
        digests = file_digests(full, stats, cache_path)
    except OSError as e:
        raise ValueError(f"cannot read model file {e.filename or path!r}: {e.strerror or e}") from None
    h = hashlib.blake2b(digest_size=16, person=b"kvblend-ckpt2")
    for name, st, digest in zip(names, stats, digests, strict=True):
        h.update(name.encode() + b"\0" + struct.pack("<Q", st.st_size) + bytes.fromhex(digest))
    return h.hexdigest()


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def file_digests(paths: list[str], stats: list[os.stat_result], cache_path: str | None) -> list[str]:
    """:func:`hash_file` of each of ``paths`` (``stats``: their ``os.stat``), from this process's
    memory, else the JSON cache at ``cache_path``, else hashed (one thread per file, at most 8)
    and added to both.

    Raises:
        OSError: a file cannot be read.
    """
    ids = [_identity(st) for st in stats]
    with _memo_lock:
        found = {i: _memo[i] for i in ids if i in _memo}
    if len(found) < len(set(ids)) and cache_path:
        found.update(_from_cache(_read_cache(cache_path), ids))
    missing = [(p, i) for p, i in zip(paths, ids, strict=True) if i not in found]
    if missing:
        with _cache_lock(cache_path):
            entries = _read_cache(cache_path) if cache_path else {}
            found.update(_from_cache(entries, ids))  # hashed by another process meanwhile
            todo = {i: p for p, i in missing if i not in found}
            if todo:
                found.update(_hash_all(todo))
                if cache_path:
                    for i in todo:
                        if i in found:
                            entries.pop(f"{i[0]}:{i[1]}", None)  # re-insert: newest last
                            entries[f"{i[0]}:{i[1]}"] = [i[2], i[3], i[4], found[i]]
                    _write_cache(cache_path, entries)
    with _memo_lock:
        _memo.update(found)
    return [found[i] if i in found else _unstable(p) for p, i in zip(paths, ids, strict=True)]


def _hash_all(todo: dict[tuple, str]) -> dict[tuple, str]:
    """Digests of ``todo`` (identity -> path); a file whose identity changed while it was hashed
    (being rewritten) is left out, so no digest of a half-written file is ever cached."""
    items = list(todo.items())
    with ThreadPoolExecutor(max_workers=max(1, min(len(items), os.cpu_count() or 1, 8))) as pool:
        digests = list(pool.map(lambda item: hash_file(item[1]), items))
    return {i: d for (i, p), d in zip(items, digests, strict=True) if _identity(os.stat(p)) == i}


def _unstable(path: str) -> str:
    """A file that changed while it was hashed: hash it again, uncached."""
    log.warning("model file %s changed while it was hashed; its digest is not cached", path)
    return hash_file(path)


def _from_cache(entries: dict, ids: list[tuple]) -> dict[tuple, str]:
    out = {}
    for i in ids:
        entry = entries.get(f"{i[0]}:{i[1]}")
        if isinstance(entry, list) and len(entry) == 4 and entry[:3] == [i[2], i[3], i[4]]:
            out[i] = str(entry[3])
    return out


def _read_cache(cache_path: str) -> dict:
    """The cache's entries (``"dev:ino" -> [size, mtime_ns, ctime_ns, digest]``); empty when the
    file is missing, unreadable or of another version."""
    try:
        with open(cache_path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    entries = data.get("files")
    return entries if isinstance(entries, dict) else {}


def _write_cache(cache_path: str, entries: dict) -> None:
    """Replace the cache file whole (temp file in the same folder + ``os.replace``); errors are
    logged, never raised."""
    while len(entries) > MAX_CACHE_ENTRIES:
        entries.pop(next(iter(entries)))
    folder = os.path.dirname(os.path.abspath(cache_path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fingerprints-", dir=folder)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"version": _CACHE_VERSION, "files": entries}, fh)
            os.replace(tmp, cache_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("cannot write the fingerprint cache %s (%s); digests stay in this process", cache_path, e)


@contextlib.contextmanager
def _cache_lock(cache_path: str | None) -> Iterator[None]:
    """Exclusive ``flock`` on ``<cache_path>.lock`` (nothing when there is no cache, or the lock
    file cannot be opened: then two processes may both hash, which is only slower)."""
    if not cache_path:
        yield
        return
    import fcntl

    try:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        fd = os.open(cache_path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
