"""A Hugging Face Hub cache built on disk from a local model folder, for tests of Hub ids with no
Hub: what ``hf download Org/Name`` leaves in ``HF_HUB_CACHE``."""

from __future__ import annotations

import os
import pathlib

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "Org/Name"


def hub_cache(root, model_dir, repo: str = REPO, commit: str = COMMIT) -> pathlib.Path:
    """A Hugging Face cache at ``root`` holding ``repo`` at ``commit`` (``refs/main``) as
    huggingface_hub lays it out: ``models--Org--Name/{refs,blobs,snapshots/<commit>}``, the
    snapshot's files relative symlinks into ``blobs/`` (here: links to ``model_dir``'s files;
    kvblend's ``kvblend-prepared.json`` left out). Returns the snapshot folder."""
    repo_dir = pathlib.Path(root) / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    for d in (snap, repo_dir / "refs", repo_dir / "blobs"):
        d.mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    for name in os.listdir(model_dir):
        if name == "kvblend-prepared.json":
            continue
        blob = repo_dir / "blobs" / name
        if not blob.is_symlink():
            blob.symlink_to(os.path.join(os.path.abspath(model_dir), name))
        (snap / name).symlink_to(os.path.join("..", "..", "blobs", name))
    return snap
