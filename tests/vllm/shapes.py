"""vLLM's connector API and scheduler shapes, per version, as ``extract_api.py`` reads them.

0.32 is read from the installed package at test time; 0.33 and 0.34 (CUDA builds pinning torch
2.14, which cannot be imported here) from the JSON committed beside this file. :func:`api` gives
the whole description; :func:`dataclass_of` and :func:`request_of` build objects shaped as that
version builds them (the fields and attributes its source defines, nothing else), so tests can
run the connector's scheduler half on them instead of on hand-written stand-ins.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import json
import pathlib
from array import array
from typing import Any

from tests.vllm.extract_api import extract

HERE = pathlib.Path(__file__).resolve().parent
API_FILES = {"0.33": HERE / "vllm_0_33_api.json", "0.34": HERE / "vllm_0_34_api.json"}
VERSIONS = ("0.32", "0.33", "0.34")

#: AST nodes a ``Request`` property may use to be rebuilt from its recorded expression
#: (``self.prefix_cache_hit_limit is not None``, ``len(self._all_token_ids)``, ...).
_SAFE_NODES = (ast.Expression, ast.Attribute, ast.Name, ast.Load, ast.Constant, ast.Compare, ast.Is,
               ast.IsNot, ast.Eq, ast.NotEq, ast.Gt, ast.GtE, ast.Lt, ast.LtE, ast.BinOp, ast.Add,
               ast.Sub, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.Call)


@functools.cache
def api(version: str) -> dict:
    """The API description of vLLM ``version`` (see ``extract_api.py``): the installed
    package's, read now, for 0.32; the committed JSON for the others.

    Raises:
        KeyError: a version with neither (add its JSON to :data:`API_FILES`).
        AssertionError: the installed vLLM is not 0.32.
    """
    if version == "0.32":
        root = pathlib.Path(importlib.util.find_spec("vllm").submodule_search_locations[0]).parent
        out = extract(root)
        assert out["vllm_version"].startswith("0.32"), f"installed vLLM is {out['vllm_version']}"
        return out
    return json.loads(API_FILES[version].read_text(encoding="utf-8"))


@functools.cache
def _dataclass(version: str, name: str) -> type:
    fields = api(version)["classes"][name]["fields"]
    spec = [(f["name"], Any) if f["default"] is None else (f["name"], Any, dataclasses.field(default=None))
            for f in fields]
    return dataclasses.make_dataclass(f"{name}_{version.replace('.', '_')}", spec, frozen=True, slots=True)


def dataclass_of(version: str, name: str, values: dict[str, Any]) -> Any:
    """vLLM ``version``'s dataclass ``name`` (``SchedulerOutput``, ``NewRequestData``,
    ``CachedRequestData``) with the fields its source declares, in its order.

    ``values`` may name fields the version lacks (dropped: one dict serves every version);
    fields with a default that ``values`` leaves out are None (vLLM's default expressions are
    not evaluated). The object is frozen and has slots: reading a field the version lacks
    raises AttributeError, as on vLLM's own object, and setting any field raises too (the
    connector must not modify what the scheduler hands it).

    Raises:
        AssertionError: ``values`` lacks a field without default (a new vLLM added one: give
            the test a value for it).
    """
    fields = api(version)["classes"][name]["fields"]
    missing = [f["name"] for f in fields if f["default"] is None and f["name"] not in values]
    assert not missing, f"vLLM {version}'s {name} requires {missing}: give the test a value for each"
    names = {f["name"] for f in fields}
    return _dataclass(version, name)(**{k: v for k, v in values.items() if k in names})


def _rebuilt_property(version: str, name: str, expression: str | None) -> property:
    """``Request.<name>`` of ``version`` from its recorded expression; one that cannot be
    rebuilt (a longer body, or nodes outside :data:`_SAFE_NODES`) raises when read, naming it."""
    tree = ast.parse(expression, mode="eval") if expression else None
    safe = tree is not None and all(
        isinstance(n, _SAFE_NODES) and (not isinstance(n, ast.Name) or n.id in ("self", "len"))
        and (not isinstance(n, ast.Call) or ast.unparse(n.func) == "len")
        for n in ast.walk(tree))
    if not safe:
        def unbuildable(self):
            raise NotImplementedError(f"vLLM {version}'s Request.{name} is not one safe expression "
                                      f"({expression!r}): tests/vllm/shapes.py cannot rebuild it")
        return property(unbuildable)
    code = compile(tree, f"<vLLM {version} Request.{name}>", "eval")
    return property(lambda self: eval(code, {"__builtins__": {"len": len}}, {"self": self}))  # noqa: S307 - checked above


@functools.cache
def _request_class(version: str) -> type:
    facts = api(version)["request"]
    namespace: dict[str, Any] = {"__slots__": tuple(a for a in facts["attributes"] if a not in facts["properties"])}
    for name, prop in facts["properties"].items():
        namespace[name] = _rebuilt_property(version, name, prop["returns"])
    return type(f"Request_{version.replace('.', '_')}", (), namespace)


def request_of(version: str, values: dict[str, Any]) -> Any:
    """A ``vllm.v1.request.Request`` of ``version`` as the scheduler's connector meets it.

    It has slots for exactly the attributes that version's ``__init__`` sets, holding
    ``values`` (entries the version lacks are dropped; attributes ``values`` leaves out are
    unset and raise AttributeError when read), and its properties computed from the recorded
    expressions (0.34's ``skip_reading_external_kv`` is ``self.prefix_cache_hit_limit is not
    None``). Where ``prompt_token_ids`` is wrapped in a ``TokenBuffer`` that is an ``array`` at
    run time (0.34), it is an int32 ``array('i')``, as vLLM's is. No method is built.
    """
    facts = api(version)["request"]
    request = _request_class(version)()
    for name, value in values.items():
        if name not in facts["attributes"]:
            continue
        if (name == "prompt_token_ids" and value is not None and "array" in api(version)["token_buffer_bases"]
                and "TokenBuffer(" in (facts["attributes"][name]["value"] or "")):
            value = array("i", value)  # TokenBuffer's typecode (vllm/v1/token_buffer.py)
        setattr(request, name, value)
    return request


def zeroes_connector_hit(version: str, request: Any) -> bool:
    """Whether vLLM ``version``'s scheduler throws away what the connector claims for
    ``request`` (the ``Request`` flags the extract's ``zeroes_connector_hit`` names)."""
    return any(getattr(request, flag) for flag in api(version)["request"]["zeroes_connector_hit"])
