"""What one ``kvblend bench blend`` run covers: its rows (``--rows A:B`` or the first N) and
its modes (``reuse``, ``recompute_all``, ``<selection>@<ratio>`` and, per ``--variant``,
``<selection>+<variant>@<ratio>``: a variant is a few blend-config values over the run's, so
knobs are compared side by side on the same rows with one full prefill per row; issue 38's
sweeps). :mod:`cluster.bench.blend` runs them."""

from __future__ import annotations

from dataclasses import dataclass


def float_list(text: str, name: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}={text!r}: expected comma-separated numbers") from None
    if not vals:
        raise ValueError(f"--{name}={text!r}: give at least one value")
    return vals


def parse_rows(text: str) -> tuple[int, int]:
    """``"A:B"`` -> ``(A, B)``: rows ``A <= i < B`` (0-based).

    Raises:
        ValueError: not two integers with ``0 <= A < B``.
    """
    parts = text.split(":")
    try:
        start, stop = (int(x) for x in parts)
    except ValueError:
        raise ValueError(f"--rows={text!r}: expected A:B, two integers (e.g. 20:150)") from None
    if not 0 <= start < stop:
        raise ValueError(f"--rows={text!r}: need 0 <= A < B")
    return start, stop


def load_rows(dataset: str, rows: str, num_examples: int) -> list:
    """Rows ``A..B-1`` of ``dataset`` for ``rows`` = ``"A:B"`` (:func:`parse_rows`), else its
    first ``num_examples`` rows, as :class:`cluster.workloads.qa.QAExample`.

    Raises:
        ValueError: a malformed slice, or one reaching past the dataset's last row.
    """
    from cluster.workloads.qa import load_examples, resolve_dataset

    if not rows:
        return load_examples(resolve_dataset(dataset), limit=num_examples)
    start, stop = parse_rows(rows)
    examples = load_examples(resolve_dataset(dataset), limit=stop)
    if len(examples) < stop:
        raise ValueError(f"--rows={rows}: {dataset} has {len(examples)} rows")
    return examples[start:stop]


def int_tuple(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{name}={text!r}: expected comma-separated integers") from None


@dataclass(frozen=True)
class Mode:
    """One row of the table: a selection at a ratio (``reuse``/``recompute_all`` are shared),
    with a variant's blend-config overrides (none: the run's config)."""

    name: str
    selection: str
    ratio: float
    overrides: tuple[tuple[str, object], ...] = ()


#: Blend-config fields a ``--variant`` may set (query-aware knobs; the rest stay per run).
VARIANT_FIELDS = ("probe_layers", "sink_tokens", "chunk_budget_power", "query_funnel", "check_layers", "rank_fusion",
                  "selection")
#: Of those, the fields that take one integer.
INT_FIELDS = ("sink_tokens", "rank_fusion")


def parse_variant(words: list[str]) -> tuple[str, tuple[tuple[str, object], ...]]:
    """``NAME KEY=VALUE ...`` (one ``--variant``) as ``(name, ((field, value), ...))``:
    ``probe_layers=8,11,15``, ``sink_tokens=8``, ``chunk_budget_power=1.5``, ``query_funnel=2``,
    ``check_layers=4``, ``rank_fusion=60``; ``selection=query_k_deviation`` runs the variant
    under that query-aware selection only (the knobs of one selection mean nothing to another).

    Raises:
        ValueError: no name, a key not in :data:`VARIANT_FIELDS`, or a value of the wrong type.
    """
    from blend.config import SELECTIONS, BlendConfig

    if not words or "=" in words[0] or "@" in words[0] or "+" in words[0]:
        raise ValueError(f"--variant {' '.join(words)!r}: give a name (no '=', '@' or '+'), then KEY=VALUE pairs")
    out = []
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key not in VARIANT_FIELDS:
            raise ValueError(f"--variant {words[0]}: {key!r} is not one of {', '.join(VARIANT_FIELDS)}")
        if key in ("probe_layers", "check_layers"):
            out.append((key, int_tuple(value, key)))
            continue
        if key == "selection":
            if not value.startswith("query_") or value not in SELECTIONS:
                raise ValueError(f"--variant {words[0]}: selection={value!r} is not a query-aware selection")
            out.append((key, value))
            continue
        nums = float_list(value, key)
        if len(nums) != 1 or (key in INT_FIELDS and nums[0] != int(nums[0])):
            raise ValueError(f"--variant {words[0]}: {key}={value!r} must be one {'integer' if key in INT_FIELDS else 'number'}")
        out.append((key, int(nums[0]) if key in INT_FIELDS else nums[0]))
    BlendConfig(**dict(out))  # out of range, or check_layers=(): refused now, before the model loads
    return words[0], tuple(out)


def modes_of(ratios: list[float], selections: list[str],
           variants: list[tuple[str, tuple]] | None = None) -> list[Mode]:
    """``reuse`` for ratio 0, ``recompute_all`` for ratio 1, ``<selection>@<ratio>`` between
    (nothing to rank at 0 or 1: every selection gives the same rows there). With ``variants``,
    every query-aware selection runs once per variant (instead of once), named
    ``<selection>+<variant>@<ratio>``; a variant that names a ``selection`` runs under that
    one only.

    Raises:
        ValueError: two variants of one name, a variant whose selection is not run, or a
            query-aware selection no variant runs under.
    """
    names = [name for name, _ in variants or ()]
    if len(set(names)) != len(names):
        raise ValueError(f"--variant names must differ: {names}")
    if variants:  # a variant's selection must run, and every query-aware selection must get a variant
        named = {dict(over).get("selection") for _, over in variants} - {None}
        if named - set(selections):
            raise ValueError(f"--variant names selection {sorted(named - set(selections))}, not in --selection")
        bare = [s for s in selections if s.startswith("query_") and s not in named
                and all("selection" in dict(over) for _, over in variants)]
        if bare:
            raise ValueError(f"no --variant runs under {bare}: give one without selection= or drop it from --selection")
    modes = []
    for r in ratios:
        if r == 0.0:
            modes.append(Mode("reuse", "k_deviation", 0.0))
        elif r == 1.0:
            modes.append(Mode("recompute_all", "k_deviation", 1.0))
        else:
            for sel in selections:
                if variants and sel.startswith("query_"):
                    modes += [Mode(f"{sel}+{name}@{r:g}", sel, r, over) for name, over in variants
                              if dict(over).get("selection", sel) == sel]
                else:
                    modes.append(Mode(f"{sel}@{r:g}", sel, r))
    return modes
