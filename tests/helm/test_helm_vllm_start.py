"""The vLLM pod's start script, run by bash with stand-in ``ray`` and ``vllm`` commands.

The script keeps the pod a Ray node: ``ray start --block`` runs in a background loop and is
started again whenever it returns (the head was unreachable, or the raylet gave up after the
head stayed away past Ray's GCS reconnect timeout). vLLM waits for the first join (Ray's
``ray_current_cluster`` file) at most ``RAY_JOIN_TIMEOUT_S`` and is ``exec``-ed, so it is the
container's main process and receives its signals. No Ray, no cluster: the stand-ins record
their calls; each test kills the process group it started.
"""

from __future__ import annotations

import pytest
import os
import signal
import stat
import subprocess
import time

pytestmark = pytest.mark.integration

HEAD = "kvb-kvblend-head.serving.svc:6379"

# Behaviour per call, one word a line of $STUB/plan: fail (head unreachable), run (joins, then
# the raylet exits after 0.5 s), stay (joins and blocks); past the plan: fail.
RAY = """#!/bin/bash
n=$(( $(cat "$STUB/count" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$STUB/count"
echo "$*" >> "$STUB/ray.log"
case "$(sed -n "${n}p" "$STUB/plan")" in
  run)  mkdir -p "$RAY_TMPDIR/ray"; echo -n "$RAY_HEAD_ADDRESS" > "$RAY_TMPDIR/ray/ray_current_cluster"
        sleep 0.5; exit 1 ;;
  stay) mkdir -p "$RAY_TMPDIR/ray"; echo -n "$RAY_HEAD_ADDRESS" > "$RAY_TMPDIR/ray/ray_current_cluster"
        exec sleep 60 ;;
  *)    exit 1 ;;
esac
"""
VLLM = """#!/bin/bash
if [ -s "$RAY_TMPDIR/ray/ray_current_cluster" ]; then joined=yes; else joined=no; fi
echo "$$ $joined $(cat "$STUB/count") $*" > "$STUB/vllm.log"
trap 'echo term >> "$STUB/vllm.log"; exit 0' TERM
sleep "$VLLM_STUB_S" & wait $!
echo "calls $(cat "$STUB/count")" >> "$STUB/vllm.log"
"""


def _script(helm) -> tuple[list[str], dict[str, str]]:
    """The vLLM container's argv and its literal environment, as the chart renders them."""
    container = helm.render(None).one("Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    return container["command"] + container["args"], env


def _start(helm, tmp_path, plan: list[str], join_timeout_s: int, vllm_s: float):
    argv, env = _script(helm)
    stub = tmp_path / "stub"
    stub.mkdir()
    for name, text in (("ray", RAY), ("vllm", VLLM)):
        (stub / name).write_text(text)
        (stub / name).chmod(stat.S_IRWXU)
    (stub / "plan").write_text("\n".join(plan) + "\n")
    (stub / "count").write_text("0")
    env.update(PATH=f"{stub}:{os.environ['PATH']}", STUB=str(stub), RAY_TMPDIR=str(tmp_path),
               RAY_HEAD_ADDRESS=HEAD, POD_IP="10.0.0.9", RAY_JOIN_TIMEOUT_S=str(join_timeout_s),
               RAY_REJOIN_INTERVAL_S="0.2", VLLM_STUB_S=str(vllm_s))
    # stderr to a file: a pipe would stay open as long as the loop lives
    with open(stub / "stderr", "w") as err:
        proc = subprocess.Popen(argv, env=env, stderr=err, start_new_session=True)
    return proc, stub


def _stop(proc) -> None:
    """Kill the process group this test started (the script's loop outlives vLLM's stand-in)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def test_vllm_waits_for_the_first_join_and_the_node_rejoins_after_it_stopped(helm, tmp_path):
    proc, stub = _start(helm, tmp_path, ["fail", "run", "fail", "stay"], join_timeout_s=30, vllm_s=4)
    try:
        proc.wait(30)
    finally:
        _stop(proc)
    stderr = (stub / "stderr").read_text()
    pid, joined, calls_at_start, *vllm_args = (stub / "vllm.log").read_text().splitlines()[0].split()
    assert int(pid) == proc.pid  # exec: vLLM is the container's process, not a child of bash
    assert joined == "yes" and int(calls_at_start) >= 2  # started after the first join
    assert vllm_args[:2] == ["serve", "Qwen/Qwen2.5-7B-Instruct"]
    # the raylet exited after the join; the loop started it again, and again after a failure
    assert (stub / "vllm.log").read_text().splitlines()[-1] == "calls 4"
    calls = (stub / "ray.log").read_text().splitlines()
    assert len(calls) == 4
    for call in calls:
        words = call.split()
        assert words[0] == "start" and "--block" in words and f"--address={HEAD}" in words
        assert "--num-cpus=0" in words and "--num-gpus=0" in words
    assert stderr.count("Ray node stopped") >= 3 and "cannot join" not in stderr


def test_vllm_starts_without_ray_after_the_join_timeout_and_the_loop_keeps_trying(helm, tmp_path):
    proc, stub = _start(helm, tmp_path, [], join_timeout_s=1, vllm_s=1.5)
    try:
        proc.wait(30)
    finally:
        _stop(proc)
    stderr = (stub / "stderr").read_text()
    first, last = (stub / "vllm.log").read_text().splitlines()[0], (stub / "vllm.log").read_text().splitlines()[-1]
    assert first.split()[1] == "no"
    assert "cannot join Ray" in stderr
    assert int(last.split()[1]) > int(first.split()[2])  # still trying while vLLM serves


def test_the_pods_termination_signal_reaches_vllm(helm, tmp_path):
    proc, stub = _start(helm, tmp_path, ["stay"], join_timeout_s=30, vllm_s=30)
    try:
        deadline = time.monotonic() + 20
        while not (stub / "vllm.log").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)  # the stand-in sets its trap right after writing its log
        os.kill(proc.pid, signal.SIGTERM)  # what the kubelet sends to the container's main process
        assert proc.wait(10) == 0
    finally:
        _stop(proc)
    assert (stub / "vllm.log").read_text().splitlines()[-1] == "term"
