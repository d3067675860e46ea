"""``kvblend bench blend --rows A:B`` (issue 38): the slice names exactly rows A..B-1 of the
file, the tuning and reporting splits are disjoint, and malformed or out-of-range slices are
errors before anything runs."""

from __future__ import annotations

import json

import pytest

from cluster.bench.blend_modes import load_rows, parse_rows
from cluster.workloads.qa import resolve_dataset

pytestmark = pytest.mark.unit


def _ids(dataset: str) -> list[str]:
    with open(resolve_dataset(dataset)) as fh:
        return [str(json.loads(line)["id"]) for line in fh if line.strip()]


@pytest.mark.parametrize("dataset, rows, start, stop", [("musique", "20:150", 20, 150),
                                                         ("wikimqa", "20:102", 20, 102),
                                                         ("wikimqa", "0:20", 0, 20)])
def test_rows_pick_exactly_the_rows_named(dataset, rows, start, stop):
    got = load_rows(dataset, rows, num_examples=5)
    assert [ex.id for ex in got] == _ids(dataset)[start:stop]


def test_without_rows_the_first_n_rows_are_read():
    assert [ex.id for ex in load_rows("musique", "", num_examples=3)] == _ids("musique")[:3]


def test_tuning_and_reporting_rows_share_no_example():
    tune = {ex.id for ex in load_rows("musique", "20:150", 0)}
    report = {ex.id for ex in load_rows("wikimqa", "20:102", 0)}
    seen = {ex.id for ex in load_rows("musique", "0:20", 0)} | {ex.id for ex in load_rows("wikimqa", "0:20", 0)}
    assert len(tune) == 130 and len(report) == 82
    assert not tune & report and not (tune | report) & seen


@pytest.mark.parametrize("bad", ["20", "a:b", "20:10", "-1:5", "5:5", "1:2:3"])
def test_malformed_rows_are_refused(bad):
    with pytest.raises(ValueError, match="--rows"):
        parse_rows(bad)


def test_rows_past_the_end_are_refused():
    with pytest.raises(ValueError, match="102 rows"):
        load_rows("wikimqa", "20:103", 0)


def test_a_checkpoint_writes_the_rows_whole_and_a_failed_one_does_not_stop_the_run(tmp_path, caplog):
    """A long run keeps what it measured: the checkpoint replaces the JSON whole; one that
    cannot be written is logged and returns False instead of raising."""
    from cluster.bench.blend import checkpoint

    path = tmp_path / "out.json"
    assert checkpoint(str(path), {"musique": {"examples": [{"id": "a"}]}})
    assert json.loads(path.read_text()) == {"datasets": {"musique": {"examples": [{"id": "a"}]}}}
    assert not (tmp_path / "out.json.tmp").exists()
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level("WARNING"):
        assert not checkpoint(str(blocked / "out.json"), {"musique": {}})  # a file where a folder must be
    assert "checkpoint" in caplog.text and json.loads(path.read_text())["datasets"]["musique"]["examples"]


def test_variants_run_each_query_selection_once_per_variant():
    from cluster.bench.blend_modes import modes_of, parse_variant

    variants = [parse_variant(["base"]), parse_variant(["cb2", "chunk_budget_power=2", "probe_layers=4,8"])]
    modes = modes_of([0.0, 0.15, 1.0], ["k_deviation", "query_attention"], variants)
    assert [m.name for m in modes] == ["reuse", "k_deviation@0.15", "query_attention+base@0.15",
                                       "query_attention+cb2@0.15", "recompute_all"]
    assert modes[3].overrides == (("chunk_budget_power", 2.0), ("probe_layers", (4, 8)))
    assert modes[2].overrides == () and modes[1].overrides == ()
    assert parse_variant(["s8", "sink_tokens=8"]) == ("s8", (("sink_tokens", 8),))
    for bad in (["chunk_budget_power=2"], ["x", "selection=k_deviation"], ["x", "sink_tokens=a"], [],
                ["x", "sink_tokens=1.5"], ["x", "query_funnel=2,3"], ["x", "query_funnel=0.5"],
                ["x", "chunk_budget_power=100"], ["x", "check_layers="], ["a@b"]):
        with pytest.raises(ValueError):
            parse_variant(bad)
    with pytest.raises(ValueError):
        modes_of([0.15], ["query_attention"], [parse_variant(["a"]), parse_variant(["a", "sink_tokens=2"])])


def test_a_variant_that_names_a_selection_runs_under_that_selection_only():
    from cluster.bench.blend_modes import modes_of, parse_variant

    rrf = parse_variant(["rrf60", "selection=query_k_deviation", "rank_fusion=60"])
    assert rrf == ("rrf60", (("selection", "query_k_deviation"), ("rank_fusion", 60)))
    modes = modes_of([0.15], ["query_attention", "query_k_deviation"], [parse_variant(["base"]), rrf])
    assert [m.name for m in modes] == ["query_attention+base@0.15", "query_k_deviation+base@0.15",
                                       "query_k_deviation+rrf60@0.15"]
    for bad in (["x", "rank_fusion=1.5"], ["x", "rank_fusion=-1"], ["x", "selection=nope"],
                ["x", "selection=k_deviation"]):
        with pytest.raises(ValueError):
            parse_variant(bad)
    with pytest.raises(ValueError, match="not in --selection"):
        modes_of([0.15], ["query_attention"], [rrf])
    with pytest.raises(ValueError, match="no --variant runs under"):
        modes_of([0.15], ["query_attention", "query_k_deviation"], [rrf])
