"""``kvblend ingest --data`` rows (issue 35): a knowledge base's ``{"passages": [...]}`` row
has no question, and ingest reads it; benchmarks, which ask the question, still refuse it.
Malformed rows are errors naming their line, never a crash or a passage split into letters."""

from __future__ import annotations

import argparse
import json

import pytest

from cluster.workloads import ingest
from cluster.workloads.qa import load_examples

pytestmark = pytest.mark.unit


def _write(tmp_path, rows) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_without_a_question_are_a_knowledge_base_for_ingest(tmp_path):
    path = _write(tmp_path, [{"passages": ["alpha text", "beta text"]}, {"id": "k2", "passages": ["gamma"]},
                             "delta alone", {"text": "epsilon"}])
    rows = load_examples(path, questions=False)
    assert [r.passages for r in rows] == [("alpha text", "beta text"), ("gamma",), ("delta alone",), ("epsilon",)]
    assert [r.question for r in rows] == ["", "", "", ""] and rows[1].id == "k2"
    assert ingest.unique_passages(rows) == ["alpha text", "beta text", "gamma", "delta alone", "epsilon"]


def test_benchmarks_still_need_the_question(tmp_path):
    path = _write(tmp_path, [{"question": "q?", "passages": ["a"]}, {"passages": ["b"]}])
    with pytest.raises(ValueError, match=r":2: missing field 'question'"):
        load_examples(path)


@pytest.mark.parametrize("row, why", [(5, "expected a JSON object or string"),
                                       ({"passages": "one string"}, "passages must be a list"),
                                       ({"question": "q"}, "missing field 'passages'")])
def test_malformed_rows_name_their_line(tmp_path, row, why):
    path = _write(tmp_path, [{"passages": ["ok"]}, row])
    with pytest.raises(ValueError, match=rf":2: {why}"):
        load_examples(path, questions=False)


def test_ingest_reads_its_corpus_without_questions(tmp_path, monkeypatch):
    """``kvblend ingest``'s own reading of ``--data`` (the model and cache stopped short)."""
    seen = {}

    class _Stop(Exception):
        pass

    def fake_unique(rows):
        seen["rows"] = rows
        raise _Stop

    monkeypatch.setattr(ingest, "unique_passages", fake_unique)
    p = argparse.ArgumentParser()
    ingest.add_arguments(p)
    args = p.parse_args(["--data", _write(tmp_path, [{"passages": ["x", "y"]}])])
    with pytest.raises(_Stop):
        ingest.run(args)
    assert [r.passages for r in seen["rows"]] == [("x", "y")]
