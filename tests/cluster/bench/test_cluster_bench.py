"""``kvblend bench cluster`` where an object key exists (``~/.kvblend/object_key``, which
``kvblend server`` creates): the shards it starts sign and check chunk objects with that key,
so the bench's own process must too. Before the fix every put was refused ("object without a
MAC") and the bench stopped at "a stored chunk was missed"."""

from __future__ import annotations

import json
import os

import pytest

from cluster.cli.main import main
from tiers import auth

pytestmark = pytest.mark.cluster


def test_bench_cluster_runs_where_an_object_key_exists(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".kvblend").mkdir(parents=True)
    key = home / ".kvblend" / "object_key"
    key.write_bytes(os.urandom(24).hex().encode())
    key.chmod(0o600)
    monkeypatch.setenv("HOME", str(home))
    for name in ("KVBLEND_OBJECT_KEY_FILE", "KVBLEND_OBJECT_KEY", "KVBLEND_OBJECT_AUTH"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "cluster.json"
    try:
        assert main(["bench", "cluster", "--quick", "--max-shards", "1", "--json", str(out)]) == 0
        assert auth.current() is not None  # this process signed with the key, as the shards checked
    finally:
        auth.configure(None)
    row = json.loads(out.read_text())["results"][0]
    assert row["lookup_ms"]["num_lookups"] > 0 and row["same_node"]["client_gbps"] > 0
    assert row["agent"]["read_gbps"] > 0
