"""cluster.cache.factory.make_client: the Ray client when shards are reachable, else the
documented fallbacks (faults injected by replacing ``connect`` / ``local_client``)."""

from __future__ import annotations

import threading
import uuid

import pytest

from cluster.cache import factory
from cluster.cache.local import LocalCacheClient, local_client
from cluster.config import load_config
from tests.factories import NAMESPACE, make_key, make_kv
from tiers.disk import DiskTier
from tiers.host import HostTier


@pytest.fixture
def config(tmp_path):
    return load_config(environ={}, overrides={"disk_path": str(tmp_path)})


def _namespace() -> str:
    """A digest no other test used (the factory shares clients per namespace per process)."""
    return uuid.uuid4().hex[:16]


@pytest.mark.unit
def test_without_ray_one_disk_client_per_namespace_is_shared(config, monkeypatch):
    monkeypatch.setattr(factory, "connect", lambda cluster_config: None)
    ns, other = _namespace(), _namespace()
    client = factory.make_client(config, ns)
    assert isinstance(client, LocalCacheClient) and isinstance(client.tier, DiskTier)
    assert factory.make_client(config, ns) is client
    assert factory.make_client(config, other) is not client
    assert factory.make_client(config, ns, device="meta") is not client  # per device too
    # the machine-local cache: another process's client over the same directory sees the chunk
    key, kv = make_key(1, namespace=ns), make_kv(1)
    client.put(key, kv)
    assert local_client(config).contains([key]) == [True]


@pytest.mark.unit
def test_a_client_that_cannot_be_built_falls_back_with_a_warning(config, monkeypatch, caplog):
    def broken(cluster_config):
        raise RuntimeError("GCS handshake failed")

    monkeypatch.setattr(factory, "connect", broken)
    ns = _namespace()
    client = factory.make_client(config, ns, fallback_on_error=True)
    assert isinstance(client, LocalCacheClient)
    assert factory.make_client(config, ns, fallback_on_error=True) is client
    assert ("kvblend: cache client unavailable (RuntimeError: GCS handshake failed); using a local cache"
            in caplog.text)


@pytest.mark.unit
def test_without_fallback_on_error_the_caller_sees_the_error(config, monkeypatch):
    """ingest and the demo (no fallback): a malformed address is the caller's ValueError, a
    broken disk cache an error, never a silent in-memory cache that is lost at exit."""
    bad = load_config(environ={}, overrides={"disk_path": config.tiers.disk_path,
                                              "ray_address": "no-port-here"})
    with pytest.raises(ValueError, match="ray_address"):
        factory.make_client(bad, _namespace())

    def no_disk(config, device="cpu"):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(factory, "connect", lambda cluster_config: None)
    monkeypatch.setattr(factory, "local_client", no_disk)
    with pytest.raises(PermissionError):
        factory.make_client(config, _namespace())


@pytest.mark.unit
def test_a_disk_cache_that_cannot_be_opened_falls_back_to_memory(config, monkeypatch, caplog):
    def no_disk(config, device="cpu"):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(factory, "connect", lambda cluster_config: None)
    monkeypatch.setattr(factory, "local_client", no_disk)
    ns = _namespace()
    client = factory.make_client(config, ns, fallback_on_error=True)
    assert isinstance(client.tier, HostTier)
    assert factory.make_client(config, ns, fallback_on_error=True) is client    # the scheduler and worker share it
    assert "cache client unavailable (PermissionError: read-only file system)" in caplog.text


@pytest.mark.cluster
def test_with_shards_a_ray_client_whose_threads_run_the_initializer(kvconfig, shards):
    from cluster.cache.client import CacheClient

    ran: list[str] = []
    client = factory.make_client(kvconfig, NAMESPACE,
                                 thread_initializer=lambda: ran.append(threading.current_thread().name))
    try:
        assert isinstance(client, CacheClient)
        assert client.fetch_layer([make_key(90)], 0).result(30) == [None]   # a miss, on a pool thread
        assert ran and ran[0].startswith("kvblend-client")
    finally:
        client.close()
