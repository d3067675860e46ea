"""``kvblend server --block`` with the Ray dashboard and token authentication on: the
dashboard's HTTP API lists the shard actors (and refuses a request without the token), and
the dashboard's actors page, rendered by headless Chromium (``apt-get install -y chromium``;
skipped without it), shows their names.

This test starts its own Ray (in the server process, killed at the end by its pid) with a
small object store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

from cluster.workloads.services import free_port

pytestmark = pytest.mark.cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _get(url: str, token: str | None):
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    return urllib.request.urlopen(req, timeout=10)


@pytest.fixture(scope="module")
def blocking_server(tmp_path_factory):
    token = uuid.uuid4().hex
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "KVBLEND_OBJECT_KEY_FILE": str(tmp_path_factory.mktemp("dash-key") / "object-key")}
    env.pop("RAY_ADDRESS", None)
    dash_port, metrics_port = free_port(), free_port()
    ns = f"kvblend-dash-{uuid.uuid4().hex[:6]}"
    disk = tmp_path_factory.mktemp("dash-disk")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli.main", "--log-level", "WARNING", "server", "--block",
         "--ray-namespace", ns, "--disk-path", str(disk), "--host-size-gib", "0.01",
         "--disk-size-gib", "0.01", "--object-store-gib", "0.3", "--shards-per-node", "2",
         "--dashboard-port", str(dash_port), "--metrics-export-port", str(metrics_port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            proc.wait(30)
            pytest.fail(f"kvblend server exited ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        started = json.loads(line)
        yield started, token, dash_port, env
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_dashboard_api_lists_shard_actors(blocking_server):
    started, token, port, env = blocking_server
    assert len(started["shards"]) == 2  # --shards-per-node 2 on the one node
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(f"http://127.0.0.1:{port}/api/v0/actors", None)
    assert err.value.code in (401, 403)
    deadline = time.monotonic() + 60
    names: set[str] = set()
    while time.monotonic() < deadline:
        with _get(f"http://127.0.0.1:{port}/api/v0/actors?limit=1000", token) as resp:
            body = json.load(resp)
        actors = body["data"]["result"]["result"]
        names = {a.get("name") for a in actors if a.get("state") == "ALIVE"}
        if set(started["shards"]) <= names:
            break
        time.sleep(1)
    assert set(started["shards"]) <= names
    # the status command reaches the same cluster with the token from the environment
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli.main", "status", "--json", "--address", started["address"],
         "--ray-namespace", started["namespace"]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(json.loads(done.stdout)["shards"]) == sorted(started["shards"])


def _chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser")


async def _rendered_text(url: str, origin: str, token: str, debug_port: int, timeout_s: float,
                         wanted: list[str]) -> str:
    """Open ``url`` in headless Chromium with the dashboard's auth cookie set (through the
    DevTools protocol, over aiohttp's websocket client) and return the page's rendered text
    as soon as it shows every string in ``wanted`` (or at ``timeout_s``)."""
    import asyncio
    import itertools

    import aiohttp

    ids = itertools.count(1)
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 30
        while True:
            try:
                async with http.get(f"http://127.0.0.1:{debug_port}/json/list") as resp:
                    pages = [p for p in await resp.json() if p.get("type") == "page"]
                if pages:
                    break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("chromium devtools did not come up")
            await asyncio.sleep(0.3)
        async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            async def call(method: str, **params):
                msg_id = next(ids)
                await ws.send_json({"id": msg_id, "method": method, "params": params})
                async for msg in ws:
                    data = json.loads(msg.data)
                    if data.get("id") == msg_id:
                        return data.get("result", {})
                raise AssertionError("devtools connection closed")

            await call("Network.enable")
            await call("Network.setCookie", name="ray-authentication-token", value=token,
                       url=origin, path="/")
            await call("Page.navigate", url=url)
            text, end = "", time.monotonic() + timeout_s
            while time.monotonic() < end and not all(w in text for w in wanted):
                await asyncio.sleep(0.5)
                res = await call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                                 returnByValue=True)
                text = res.get("result", {}).get("value", "") or ""
            return text


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install -y chromium)")
def test_dashboard_renders_shard_names_in_chromium(blocking_server, tmp_path):
    import asyncio

    started, token, port, _ = blocking_server
    debug_port = free_port()
    proc = subprocess.Popen(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
         f"--remote-debugging-port={debug_port}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        origin = f"http://127.0.0.1:{port}"
        text = asyncio.run(_rendered_text(f"{origin}/#/actors", origin, token, debug_port, 60,
                                          started["shards"]))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for name in started["shards"]:
        assert name in text, text[:2000]
