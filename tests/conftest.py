"""Lanes, the isolation of every test from the others, the GPU skip, and the prepared model.

**Lanes.** Every test carries exactly one lane marker (registered in pyproject.toml; collection
fails otherwise), and ``scripts/test.sh`` runs each lane as its own pytest process (``-m LANE``):

* ``unit``: no vLLM engine, no Ray, no process started: pure Python and torch, in parallel over
  the machine's cores. A unit test that starts a process fails (:func:`_no_process_guard`).
* ``engine``: vLLM engines (the in-process ``blend_llm``, ``vllm serve``, engine subprocesses).
* ``cluster``: Ray clusters, shards and the cache agent, the services (redis-server, S3), faults
  and every other test that starts a process (``kvblend`` commands, fresh interpreters).
* ``integration``: what a user runs whole: README lines, the demo, the benchmarks, the Helm chart.

So a test that starts a process is marked so: by any lane but ``unit``.

**Isolation** (no test depends on another's order or leftovers):

* per pytest process (a lane, an xdist worker): a private ``RAY_TMPDIR`` (Ray's ``auto`` file and
  session folders), a private ``HOME`` (``~/.ray/auth_token``, ``~/.cache/kvblend``: shard
  identities, fingerprints; only the prepared models are shared, through a link to the user's
  model cache, since preparing one takes ~20 s and gives the same folder every time), no
  ``RAY_ADDRESS``, ``RAY_AUTH_*`` or ``KVBLEND_*`` (but ``KVBLEND_LOG_LEVEL``) inherited from
  the caller's shell, and throwaway AWS credentials (the suite's S3 endpoint takes any);
* per module: a fresh ``RAY_TMPDIR`` (a module's heads and its ``auto`` are its own),
  ``os.environ`` restored at its end, the object key a ``kvblend server`` of the module created
  in the private ``HOME`` (``~/.kvblend/object_key``) removed at its end, and no Ray driver left connected (a leak fails the module
  instead of being tidied away);
* per test: ``os.environ`` as it was before the test, a fresh ``KVBLEND_DISK_PATH`` and a free
  ``KVBLEND_HEAD_PORT`` (the port of a head ``kvblend server`` starts).

Services (redis-server, the S3 endpoint) are started by fixtures in ``tests/services.py`` (a
plugin of this conftest); Ray clusters by ``tests/cluster/conftest.py``; vLLM engines by
``tests/cluster/vllm/conftest.py``. Factories are in ``tests/factories.py``.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.process
import os
import shutil
import subprocess
import tempfile

import pytest

#: The service fixtures (redis_url, s3_endpoint, private_redis, ...) for every test directory.
pytest_plugins = ["tests.services"]

#: The lanes, in the order scripts/test.sh runs them.
LANES = ("unit", "engine", "cluster", "integration")

_REAL_HOME = os.path.expanduser("~")
# Short paths: Ray puts Unix sockets under RAY_TMPDIR (107 bytes at most).
_PROCESS_DIR = tempfile.mkdtemp(prefix="kvbt-", dir="/tmp")


def _isolate_process() -> None:
    """Point everything machine-wide at this pytest process's own folder (see the docstring)."""
    for name in [k for k in os.environ if k.startswith(("KVBLEND_", "RAY_ADDRESS", "RAY_AUTH_"))
                 and k != "KVBLEND_LOG_LEVEL"]:
        del os.environ[name]
    home = os.path.join(_PROCESS_DIR, "home")
    models = os.path.join(_REAL_HOME, ".cache", "kvblend", "models")
    os.makedirs(models, exist_ok=True)
    os.makedirs(os.path.join(home, ".cache", "kvblend"))
    os.symlink(models, os.path.join(home, ".cache", "kvblend", "models"))
    os.environ["HOME"] = home
    os.environ["RAY_TMPDIR"] = os.path.join(_PROCESS_DIR, "ray")
    os.makedirs(os.environ["RAY_TMPDIR"])
    # the S3 endpoint the suite starts takes any credentials; a caller's real ones never reach
    # a test, and the session's endpoint outlives every module's restore of the environment
    os.environ.update(AWS_ACCESS_KEY_ID="kvblend-test", AWS_SECRET_ACCESS_KEY="kvblend-test",
                      AWS_DEFAULT_REGION="us-east-1")
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        os.environ.pop(name, None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["KVBLEND_DISK_PATH"] = os.path.join(_PROCESS_DIR, "disk")


_isolate_process()


def pytest_addoption(parser):
    parser.addoption("--keep-test-dirs", action="store_true",
                     help="keep this process's private HOME/RAY_TMPDIR folder (" + _PROCESS_DIR + ")")


_EXIT = {}


def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Remove this process's folder; then, in a process that imported Ray, end at once with
    the session's status. Ray's core worker can crash the interpreter's own teardown after the
    last driver disconnected (SIGSEGV in its log sink, seen once in a whole-suite run and once
    in the cluster lane, every test passed): the results are written by then, and the product's
    Ray processes end the same way (the cache agent's ``os._exit``)."""
    if not config.getoption("--keep-test-dirs", default=False):
        shutil.rmtree(_PROCESS_DIR, ignore_errors=True)
    import sys

    if "ray" in sys.modules and "status" in _EXIT and not hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT["status"])


def lane_of(item) -> str:
    """The lane marker of ``item``.

    Raises:
        ValueError: none, or more than one.
    """
    lanes = sorted({m.name for m in item.iter_markers() if m.name in LANES})
    if len(lanes) != 1:
        raise ValueError(f"{item.nodeid}: lanes {lanes or 'none'}; exactly one of {', '.join(LANES)} "
                         "(pytestmark = pytest.mark.<lane>, or a decorator per test in a mixed module)")
    return lanes[0]


def pytest_collection_modifyitems(config, items):
    errors = []
    for item in items:
        try:
            lane_of(item)
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise pytest.UsageError("every test belongs to exactly one lane (tests/conftest.py):\n"
                                + "\n".join(errors))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


class ProcessStarted(AssertionError):
    """A ``unit`` test started a process (it belongs in another lane)."""


@contextlib.contextmanager
def _no_process_guard(nodeid: str):
    """While active, starting a process (``subprocess``, ``multiprocessing``, ``os.fork``,
    ``os.posix_spawn``) raises :class:`ProcessStarted`."""

    def refuse(*args, **kwargs):
        raise ProcessStarted(f"{nodeid} is in the unit lane but starts a process: mark it with the "
                             "lane of what it starts (tests/conftest.py)")

    mp = pytest.MonkeyPatch()
    mp.setattr(subprocess.Popen, "_execute_child", refuse)
    mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    mp.setattr(os, "fork", refuse)
    mp.setattr(os, "posix_spawn", refuse)
    mp.setattr(os, "posix_spawnp", refuse)
    try:
        yield
    finally:
        mp.undo()


@functools.cache
def _imports_that_start_a_process() -> None:
    """Imports whose module body starts a process, done once before the first unit test's
    guard: py-cpuinfo (vLLM imports it) runs ``file -b <python>`` through
    ``platform.architecture()``, so a unit test that is the process's first to import vLLM
    (``bash scripts/test.sh unit -- tests/test_layering.py``) failed alone and passed in the lane."""
    with contextlib.suppress(ImportError):
        import cpuinfo  # noqa: F401


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Unit tests run (setup, call, teardown) under :func:`_no_process_guard`; not those marked
    ``gpu``: CUDA's libraries start helpers of their own (triton runs ``ldconfig -p``)."""
    if lane_of(item) != "unit" or item.get_closest_marker("gpu") is not None:
        return (yield)
    _imports_that_start_a_process()
    with _no_process_guard(item.nodeid):
        return (yield)


@pytest.fixture(autouse=True, scope="module")
def _module_isolation():
    """A fresh ``RAY_TMPDIR`` for the module, and ``os.environ`` as it was once the module
    ends (what its module fixtures set goes with them); at its end, no Ray driver may be left
    connected (fixtures that connect one disconnect it: a leak would attach later modules to a
    cluster that is gone, and a Ray API call without ``ray.init`` starts a whole local Ray)."""
    saved = dict(os.environ)
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="r", dir=_PROCESS_DIR)
    yield
    os.environ.clear()
    os.environ.update(saved)
    # a module's `kvblend server` keys its own processes only (later modules start keyless)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(os.environ["HOME"], ".kvblend", "object_key"))
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("this module left the test process connected to Ray (disconnect in the "
                    "fixture that connected it)")


@pytest.fixture(autouse=True)
def _test_isolation(tmp_path_factory):
    """``os.environ`` restored after the test; a fresh ``KVBLEND_DISK_PATH`` (the machine-local
    disk cache of clients built without Ray) and a free ``KVBLEND_HEAD_PORT`` for it."""
    from cluster.workloads.services import free_port

    saved = dict(os.environ)
    os.environ["KVBLEND_DISK_PATH"] = str(tmp_path_factory.mktemp("disk", numbered=True))
    # a head `kvblend server` starts listens on a free port, never the machine's fixed 6390
    os.environ["KVBLEND_HEAD_PORT"] = str(free_port())
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """HF folder of the bundled SmolLM2-135M-Instruct (prepared once, cached)."""
    from cluster.config import cache_dir, load_config
    from cluster.workloads.model import resolve_model

    return resolve_model("smollm2", cache_dir(load_config(environ={})))
