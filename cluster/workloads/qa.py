"""Multi-document QA data (../shared/data/qa/) and answer scoring.

Rows are ``{"id", "question", "passages": [str], "answers": [str]}`` (the ``*.norm.jsonl``
files). Scoring is SQuAD's token F1 (lower-case, strip punctuation and articles, split on
whitespace), max over gold answers.
"""

from __future__ import annotations

import collections
import json
import os
import re
import string
from dataclasses import dataclass

DEFAULT_DATA_DIRS = ("../shared/data/qa", "shared/data/qa")
DATASETS = {"musique": "musique_s.norm.jsonl", "wikimqa": "wikimqa_s_clean.norm.jsonl"}


@dataclass(frozen=True)
class QAExample:
    id: str
    question: str
    passages: tuple[str, ...]
    answers: tuple[str, ...]


def resolve_dataset(name_or_path: str, data_dir: str | None = None) -> str:
    """Path of a dataset given a short name (``musique``, ``wikimqa``) or a file path.

    Raises:
        ValueError: not found.
    """
    if os.path.isfile(name_or_path):
        return name_or_path
    fname = DATASETS.get(name_or_path)
    if fname is None:
        raise ValueError(f"dataset {name_or_path!r} is neither a file nor one of {sorted(DATASETS)}")
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
    candidates = [data_dir] if data_dir else []
    candidates += [os.path.join(here, d) for d in DEFAULT_DATA_DIRS]
    for d in candidates:
        if d and os.path.isfile(os.path.join(d, fname)):
            return os.path.join(d, fname)
    raise ValueError(f"dataset {name_or_path!r} ({fname}) not found in {candidates}; pass --dataset PATH")


def load_examples(path: str, limit: int | None = None, *, questions: bool = True) -> list[QAExample]:
    """Read a ``*.norm.jsonl`` file (or plain passages: one JSON string or {"text"} per line).

    Args:
        questions: whether a ``{"passages": [...]}`` row must have a ``question`` (benchmarks
            ask it); ``False`` for a knowledge base (``kvblend ingest``): its question is "".

    Raises:
        ValueError: a line that is not JSON or lacks the fields, naming the line number.
    """
    out: list[QAExample] = []
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON: {e}") from None
            if isinstance(row, str):
                row = {"id": f"p{i}", "question": "", "passages": [row], "answers": []}
            elif not isinstance(row, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object or string, got {type(row).__name__}")
            elif "text" in row and "passages" not in row:
                row = {"id": row.get("id", f"p{i}"), "question": "", "passages": [row["text"]], "answers": []}
            if not questions:
                row.setdefault("question", "")
            if not isinstance(row.get("passages", []), list):
                raise ValueError(f"{path}:{i}: passages must be a list of strings")
            try:
                out.append(QAExample(str(row.get("id", i)), str(row["question"]),
                                     tuple(map(str, row["passages"])), tuple(map(str, row.get("answers", [])))))
            except KeyError as e:
                raise ValueError(f"{path}:{i}: missing field {e}") from None
            if limit is not None and len(out) >= limit:
                break
    return out


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: str, reference: str) -> float:
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(reference).split()
    if not pred and not ref:
        return 1.0
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(ref)
    return 2 * p * r / (p + r)


def max_f1(prediction: str, answers) -> float:
    return max((token_f1(prediction, a) for a in answers), default=0.0)
