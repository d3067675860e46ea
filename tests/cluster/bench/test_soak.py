"""cluster.bench.faults.soak on a stand-in rig: what the 30-minute soak of issue 20 reports
(failed and wrong requests summed over every phase, each process's RSS at the end against its
baseline after the warm-up) and when it reads memory (after warm-up rounds of every fault until
no process's shared memory grows, and at rest). The real soak: ``kvblend bench faults --soak 1800`` (docs/benchmarks.md, Faults)."""

from __future__ import annotations

import contextlib

import pytest

from cluster.bench import fault_setup, faults

pytestmark = pytest.mark.unit


class _Rig:
    """Stand-in for FaultRig: memory readings from a script, and a log of what happened."""

    def __init__(self, readings):
        self.readings = list(readings)
        self.log: list[str] = []

    def process_memory_mib(self):
        self.log.append("read")
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def _mem(worker_rss, shard_rss=1000.0, agent_shmem=1000.0):
    return {"worker": {"rss": worker_rss, "anon": worker_rss - 100, "shmem": 0.0, "file": 100.0},
            "shard": {"rss": shard_rss, "anon": 500.0, "shmem": shard_rss - 500, "file": 0.0},
            "agent": {"rss": 300.0 + agent_shmem, "anon": 300.0, "shmem": agent_shmem, "file": 0.0}}


def _baseline_index(log):
    """The reading taken at rest after the warm-up: the first read right after a settle."""
    return next(i for i in range(1, len(log)) if log[i] == "read" and log[i - 1] == "sleep:0.125")


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(faults, "PHASE_S", (0.01, 0.02))
    monkeypatch.setattr(faults, "WARMUP_STOP_S", 0.03)
    monkeypatch.setattr(faults, "SETTLE_S", 0.125)


def _wire(monkeypatch, rig, wrong_on=None):
    sent = []

    def send(rig_, prompts, refs, max_tokens, params):
        assert params == {"kvblend_recompute_ratio": 1.0}
        sent.append(prompts[0])
        rig_.log.append("send")
        bad = wrong_on is not None and rig_.log.count("send") == wrong_on
        return {"requests": 1, "failed_requests": 0, "wrong_outputs": int(bad)}

    @contextlib.contextmanager
    def fault(rig_, row, keys, s3_delay_s):
        rig_.log.append(f"fault:{row}")
        yield {}

    monkeypatch.setattr(fault_setup, "send", send)
    monkeypatch.setattr(fault_setup, "fault", fault)
    return sent


def test_soak_reads_the_baseline_after_every_fault_and_at_rest(monkeypatch, fast):
    # warm-up: the reading before round 1, after round 1 (shared memory settled at once),
    # the baseline, then one reading per phase and the last one
    rig = _Rig([_mem(3000.0), _mem(3000.0), _mem(3000.0), _mem(3100.0)])
    sent = _wire(monkeypatch, rig)
    monkeypatch.setattr(faults.time, "sleep", lambda s: rig.log.append(f"sleep:{s}"))
    out = faults.soak(rig, [([1], "a"), ([2], "b")], seconds=0.2, max_tokens=4)
    base = _baseline_index(rig.log)
    warmup = rig.log[:base]
    assert {"fault:no_fault", "fault:redis_blackhole", "fault:s3_throttled", "fault:shard_sigstop"} <= set(warmup)
    assert [1] in sent and [2] in sent
    # at rest: SETTLE_S without a request before the baseline and before the last reading
    assert rig.log[-2:] == ["sleep:0.125", "read"]
    assert out["requests"] == len(sent) and out["failed_requests"] == 0 and out["wrong_outputs"] == 0
    assert out["rss_mib"]["worker"] == [3000.0, 3100.0, 1.033]
    assert out["rss_within_10pct"] is True
    assert out["warmup_settled"] is True and len(out["warmup_shmem_growth_mib"]) == 1
    # the warm-up stops the shard for WARMUP_STOP_S (the put window fills): requests run then
    stop = warmup.index("fault:shard_sigstop")
    assert "send" in warmup[stop + 1:]
    assert [e["row"] for e in out["timeline"][:2]] == ["warmup-1", "baseline"]


def test_soak_warms_up_until_the_object_store_pages_are_mapped(monkeypatch, fast):
    # the agent maps more of the object store in rounds 1 and 2 (+200, +100 MiB), none in
    # round 3: the baseline comes after round 3 and holds the pages, so they are not growth
    readings = [_mem(3000.0, agent_shmem=1000.0), _mem(3000.0, agent_shmem=1200.0),
                _mem(3000.0, agent_shmem=1300.0), _mem(3000.0, agent_shmem=1302.0),
                _mem(3000.0, agent_shmem=1302.0)]
    rig = _Rig(readings)
    _wire(monkeypatch, rig)
    monkeypatch.setattr(faults.time, "sleep", lambda s: rig.log.append(f"sleep:{s}"))
    out = faults.soak(rig, [([1], "a")], seconds=0.2, max_tokens=4)
    assert [r["agent"] for r in out["warmup_shmem_growth_mib"]] == [200.0, 100.0, 2.0]
    assert out["warmup_settled"] is True
    assert rig.log[:_baseline_index(rig.log)].count("fault:shard_sigstop") == 3
    assert out["rss_mib"]["agent"] == [1602.0, 1602.0, 1.0]
    assert [e["row"] for e in out["timeline"][:4]] == ["warmup-1", "warmup-2", "warmup-3", "baseline"]


def test_soak_warm_up_is_bounded_and_says_it_did_not_settle(monkeypatch, fast):
    monkeypatch.setattr(faults, "WARMUP_MAX_ROUNDS", 2)
    readings = [_mem(3000.0, agent_shmem=1000.0 + 100 * i) for i in range(4)]
    rig = _Rig(readings)
    _wire(monkeypatch, rig)
    out = faults.soak(rig, [([1], "a")], seconds=0.2, max_tokens=4)
    assert len(out["warmup_shmem_growth_mib"]) == 2
    assert out["warmup_settled"] is False


def test_soak_misses_the_rss_target_on_growth_and_counts_wrong_outputs(monkeypatch, fast):
    # before and after warm-up round 1, the baseline, then the shard grows
    rig = _Rig([_mem(3000.0), _mem(3000.0), _mem(3000.0), _mem(3000.0, shard_rss=1200.0)])
    _wire(monkeypatch, rig, wrong_on=3)
    out = faults.soak(rig, [([1], "a")], seconds=0.2, max_tokens=4)
    assert out["rss_mib"]["shard"][2] == 1.2
    assert out["rss_within_10pct"] is False
    assert out["wrong_outputs"] == 1


def test_soak_misses_the_rss_target_when_a_process_is_gone(monkeypatch, fast):
    gone = _mem(3000.0)
    del gone["shard"]
    rig = _Rig([_mem(3000.0), _mem(3000.0), _mem(3000.0), gone])
    _wire(monkeypatch, rig)
    out = faults.soak(rig, [([1], "a")], seconds=0.2, max_tokens=4)
    assert out["processes_gone"] == ["shard"]
    assert out["rss_within_10pct"] is False


def test_soak_misses_the_rss_target_when_a_process_was_not_read_at_the_baseline(monkeypatch, fast):
    # the shard answered the first reading, then not (a status call that timed out): its RSS
    # is not compared, so the target is not met
    unread = _mem(3000.0)
    del unread["shard"]
    rig = _Rig([_mem(3000.0), unread, unread, unread])
    _wire(monkeypatch, rig)
    out = faults.soak(rig, [([1], "a")], seconds=0.2, max_tokens=4)
    assert "shard" not in out["rss_mib"] and out["processes_unmeasured"] == ["shard"]
    assert out["rss_within_10pct"] is False
