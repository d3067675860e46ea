"""cluster.cache.connect's ``auto``: the address file Ray itself reads, wherever Ray's temp dir
is (a cluster started under ``RAY_TMPDIR`` was invisible to kvblend's ``auto``, which read
``/tmp/ray/ray_current_cluster`` whatever the environment said)."""

from __future__ import annotations

import pytest

from cluster.cache import connect

pytestmark = pytest.mark.unit


def test_auto_reads_the_address_file_in_rays_temp_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert connect.ray_address_file() == str(tmp_path / "ray" / "ray_current_cluster")
    assert connect._auto_address() is None  # no cluster started there
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6380\n")
    assert connect._auto_address() == "127.0.0.1:6380"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # the variable wins, as for Ray
    assert connect._auto_address() == "10.0.0.5:6379"


def test_without_rays_variable_the_file_follows_tmpdir_then_tmp(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert connect.ray_address_file() == str(tmp_path / "ray" / "ray_current_cluster")
    monkeypatch.delenv("TMPDIR")
    assert connect.ray_address_file() == "/tmp/ray/ray_current_cluster"
