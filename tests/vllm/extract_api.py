"""vLLM's KV connector API read from its source with :mod:`ast` (nothing of vLLM is imported).

A CUDA build of vLLM (0.33.0 pins torch 2.14) cannot be imported on the CPU machines that run
our tests, so the test compares :class:`cluster.vllm.connector.KVBlendConnector` with a compact
JSON description of that API, made by this script from the unzipped wheel and kept in
``tests/vllm/vllm_<version>_api.json``. The installed 0.32 is read the same way at test time.

What is recorded:

* ``classes``: the connector base ``KVConnectorBase_V1``, the ``SupportsHMA`` mixin, the
  metadata, role, stats and Prometheus base classes, ``KVTransferConfig`` and ``CacheHitSource``:
  each method with its kind (method, classmethod, staticmethod, property), whether it is
  abstract (``@abstractmethod``) or only raises ``NotImplementedError``, its parameters
  (name, kind, default and annotation as source text) and the first line of its docstring;
  dataclass and config fields; enum members; class attributes.
* ``factory``: how ``KVConnectorFactory`` loads an out-of-tree connector
  (``kv_connector_module_path``), the constructor call it makes, the keyword it requires of
  the constructor, its errors, and the in-tree connector names it registers.
* ``hma``: what ``supports_hma`` tests and what ``VllmConfig`` logs or raises at start-up
  when the connector lacks ``SupportsHMA``.
* ``callers``: for each connector method, the vLLM functions that call it (``file:Class.func``),
  found as calls on a receiver that names a connector (``self.connector``,
  ``get_kv_transfer_group()``, ``connector_cls``, ...), in-tree connectors excluded.
* the scheduler's side of the connector: ``classes`` also holds the scheduler-output
  dataclasses the connector's ``build_connector_meta`` reads (``SchedulerOutput``,
  ``NewRequestData``, ``CachedRequestData``: their fields, in order, with defaults), and
  ``request`` describes ``vllm.v1.request.Request`` (:func:`_request_facts`): every attribute
  its ``__init__`` sets, its properties (the returned expression when the body is one
  ``return``), its methods, and ``zeroes_connector_hit``, the ``Request`` flags after which
  ``Scheduler.schedule`` throws the connector's answer away (``ext_tokens, load_kv_async = 0,
  False``: prompt logprobs). Which of them kvblend reads is found at test time
  (``tests/cluster/vllm/test_vllm_shapes.py``), so the JSON stays a description of vLLM alone.

Files a release no longer has (0.34 dropped ``kv_connector_model_runner_mixin.py`` with the V1
model runner) are recorded with a null hash; classes of :data:`OPTIONAL_CLASSES` only where they
exist.

Usage (one run per wheel; the JSON is committed)::

    pip download --no-deps vllm==0.34.0 -d /tmp/vllm034
    cd /tmp/vllm034 && mkdir src && cd src && unzip -q ../vllm-0.34.0-*.whl 'vllm/*.py'
    python tests/vllm/extract_api.py /tmp/vllm034/src --wheel /tmp/vllm034/vllm-0.34.0-*.whl \\
        -o tests/vllm/vllm_0_34_api.json

``ROOT`` is any directory holding the ``vllm`` package: an unzipped wheel or a site-packages.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pathlib
import re
import sys
import zipfile

#: The files that define the connector surface, relative to ROOT.
FILES = {
    "base": "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
    "v1_init": "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py",
    "factory": "vllm/distributed/kv_transfer/kv_connector/factory.py",
    "metrics": "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py",
    "kv_transfer_config": "vllm/config/kv_transfer.py",
    "vllm_config": "vllm/config/vllm.py",
    "cache_hit_source": "vllm/v1/metrics/cache_hit_source.py",
    "scheduler": "vllm/v1/core/sched/scheduler.py",
    "sched_output": "vllm/v1/core/sched/output.py",
    "request": "vllm/v1/request.py",
    "runner_mixin": "vllm/v1/worker/kv_connector_model_runner_mixin.py",
    "runner_connector": "vllm/v1/worker/gpu/kv_connector.py",
    "token_buffer": "vllm/v1/token_buffer.py",
}

#: FILES a release may lack: hashed when present, never parsed.
OPTIONAL_FILES = ("runner_mixin", "runner_connector", "token_buffer")

#: class name -> the FILES key of the file that defines it.
CLASSES = {
    "KVConnectorBase_V1": "base",
    "SupportsHMA": "base",
    "KVConnectorRole": "base",
    "KVConnectorMetadata": "base",
    "KVConnectorWorkerMetadata": "base",
    "KVConnectorHandshakeMetadata": "base",
    "KVConnectorTransferResults": "base",
    "KVConnectorStats": "metrics",
    "KVConnectorPromMetrics": "metrics",
    "KVTransferConfig": "kv_transfer_config",
    "CacheHitSource": "cache_hit_source",
    "SchedulerOutput": "sched_output",
    "NewRequestData": "sched_output",
    "CachedRequestData": "sched_output",
    "KVCacheAccess": "kv_transfer_config",
}

#: CLASSES that only some releases define (``KVCacheAccess``: 0.34).
OPTIONAL_CLASSES = ("KVCacheAccess",)

#: Longest source text kept for one attribute's value in ``request``.
MAX_VALUE_CHARS = 200

#: Where vLLM calls connector methods (in-tree connectors under kv_connector/v1/ are skipped,
#: except the base class, whose own calls on ``self`` count: get_transfer_results -> get_finished).
CALLER_DIRS = (
    "vllm/v1/core", "vllm/v1/worker", "vllm/v1/engine", "vllm/v1/executor", "vllm/config",
    "vllm/distributed/kv_transfer", "vllm/model_executor/layers/attention",
)
CONNECTOR_DIR = "vllm/distributed/kv_transfer/kv_connector/v1/"
CALLER_KEEP = (FILES["base"], FILES["metrics"])
RECEIVER = re.compile(r"connector|kv_transfer_group", re.IGNORECASE)
NOT_KV_RECEIVER = re.compile(r"ec_connector|aux_output_connector|ec_transfer", re.IGNORECASE)

_KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")


def _text(node: ast.AST | None) -> str | None:
    """Source text of an expression; a string annotation without its quotes."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ast.unparse(node)


def _string(node: ast.AST) -> str | None:
    """A literal string (implicit concatenation included); f-strings keep ``{expr}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string(node.left), _string(node.right)
        return None if left is None or right is None else left + right
    return None


def _params(fn: ast.FunctionDef) -> list[dict]:
    """Parameters in signature order, ``self``/``cls`` included (as ``inspect`` lists them)."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [{"name": p.arg, "kind": _KINDS[0 if i < len(a.posonlyargs) else 1],
            "default": _text(d), "annotation": _text(p.annotation)}
           for i, (p, d) in enumerate(zip(positional, defaults, strict=True))]
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": _KINDS[2], "default": None,
                    "annotation": _text(a.vararg.annotation)})
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append({"name": p.arg, "kind": _KINDS[3], "default": _text(d), "annotation": _text(p.annotation)})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": _KINDS[4], "default": None,
                    "annotation": _text(a.kwarg.annotation)})
    return out


def _only_raises_not_implemented(fn: ast.FunctionDef) -> bool:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None
            and "NotImplementedError" in ast.unparse(body[0].exc))


def _method(fn: ast.FunctionDef) -> dict | None:
    names = [ast.unparse(d) for d in fn.decorator_list]
    if any(n.endswith((".setter", ".deleter")) for n in names):
        return None
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in names), "method")
    doc = ast.get_docstring(fn) or ""
    return {"kind": kind, "abstract": "abstractmethod" in names,
            "raises_not_implemented": _only_raises_not_implemented(fn),
            "params": _params(fn), "returns": _text(fn.returns),
            "doc": doc.strip().splitlines()[0] if doc.strip() else ""}


def _class(node: ast.ClassDef) -> dict:
    out: dict = {"bases": [ast.unparse(b) for b in node.bases], "methods": {}, "fields": [],
                 "attributes": {}}
    doc = ast.get_docstring(node) or ""
    out["doc"] = doc.strip().splitlines()[0] if doc.strip() else ""
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            method = _method(item)
            if method is not None:
                out["methods"][item.name] = method
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out["fields"].append({"name": item.target.id, "annotation": _text(item.annotation),
                                  "default": _text(item.value)})
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name):
                    out["attributes"][target.id] = ast.unparse(item.value)
    return out


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Every function in ``tree`` by qualified name (``Class.method``, ``func``)."""
    out: dict[str, ast.FunctionDef] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = child
                walk(child, f"{prefix}{child.name}.")

    walk(tree, "")
    return out


def _messages(node: ast.AST, needle: str) -> list[str]:
    """Literal strings under ``node`` (call arguments, raised messages) containing ``needle``."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            for arg in sub.args:
                text = _string(arg)
                if text is not None and needle.lower() in text.lower() and text not in found:
                    found.append(text)
    return found


def _factory_facts(tree: ast.Module) -> dict:
    fns = _functions(tree)
    get_cls, create = fns["KVConnectorFactory.get_connector_class"], fns["KVConnectorFactory.create_connector"]
    calls = [c for c in ast.walk(get_cls) if isinstance(c, ast.Call)]
    return {
        "module_path_import": next(ast.unparse(c) for c in calls if ast.unparse(c.func) == "importlib.import_module"),
        "class_lookup": next(ast.unparse(c) for c in calls if ast.unparse(c.func) == "getattr"),
        "required_constructor_keywords": sorted(
            _string(c.args[1]) for c in calls if ast.unparse(c.func) == "supports_kw"),
        "constructor_call": next(ast.unparse(c) for c in ast.walk(create) if isinstance(c, ast.Call)
                                 and ast.unparse(c.func) == "connector_cls"),
        "create_connector_checks_hma": "supports_hma_config" in ast.unparse(create),
        "errors": [m for fn in (get_cls, create) for sub in ast.walk(fn) if isinstance(sub, ast.Raise)
                   for m in _messages(sub, "")],
        "registered": [_string(c.args[0]) for c in ast.walk(tree) if isinstance(c, ast.Call)
                       and ast.unparse(c.func) == "KVConnectorFactory.register_connector"],
    }


def _hma_facts(base: ast.Module, vllm_config: ast.Module) -> dict:
    fn = _functions(base)["supports_hma"]
    returns = [ast.unparse(r.value) for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value]
    return {
        "supports_hma_returns": returns,
        "startup_warning": _messages(vllm_config, "Turning off hybrid kv cache manager"),
        "explicit_enable_error": _messages(vllm_config, "Hybrid KV cache manager was explicitly enabled"),
    }


def _self_assignments(fn: ast.FunctionDef) -> dict[str, dict]:
    """``{name: {"annotation", "value"}}`` for each ``self.name`` that ``fn`` assigns, in
    source order: the value of its first assignment (source text) and its annotation, if any."""
    found: dict[str, tuple[int, str | None, str]] = {}  # name -> (line, annotation, value)
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            targets, annotation = node.targets, None
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, annotation = [node.target], _text(node.annotation)
        else:
            continue
        for t in targets:
            if not (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"):
                continue
            value = ast.unparse(node.value)[:MAX_VALUE_CHARS]
            line, ann, first = found.get(t.attr, (node.lineno, None, value))
            if node.lineno < line:
                line, first = node.lineno, value
            found[t.attr] = (line, ann or annotation, first)
    return {name: {"annotation": ann, "value": value}
            for name, (_, ann, value) in sorted(found.items(), key=lambda kv: kv[1][0])}


def _single_return(fn: ast.FunctionDef) -> str | None:
    """The returned expression of a function whose body (docstring aside) is one ``return``."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
        return ast.unparse(body[0].value)
    return None


def _request_facts(request: ast.Module, scheduler: ast.Module) -> dict:
    """``Request`` as the connector meets it: ``attributes`` set by ``__init__`` (annotation,
    value as source text), ``properties`` (``returns``: the expression, or None when the body
    is more than one ``return``), ``methods`` (names), and ``zeroes_connector_hit``: the
    ``request.<flag>`` tested by an ``if`` in ``Scheduler.schedule`` whose body sets
    ``ext_tokens, load_kv_async = 0, False``.

    Raises:
        KeyError: no ``Request`` class, or no such ``if`` in ``Scheduler.schedule``.
    """
    cls = next((n for n in request.body if isinstance(n, ast.ClassDef) and n.name == "Request"), None)
    if cls is None:
        raise KeyError(f"class Request not found in {FILES['request']}")
    fns = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    properties, methods = {}, []
    for name, fn in fns.items():
        decorators = [ast.unparse(d) for d in fn.decorator_list]
        if any(d.endswith((".setter", ".deleter")) for d in decorators):
            continue
        if "property" in decorators or "cached_property" in decorators:
            properties[name] = {"returns": _single_return(fn)}
        else:
            methods.append(name)
    flags = []
    for node in ast.walk(_functions(scheduler)["Scheduler.schedule"]):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Attribute)
                and ast.unparse(node.test.value) == "request"
                and any(ast.unparse(s) == "ext_tokens, load_kv_async = (0, False)" for s in node.body)):
            flags.append(node.test.attr)
    if not flags:
        raise KeyError("Scheduler.schedule no longer zeroes the connector's hit on a request flag")
    return {"attributes": _self_assignments(fns["__init__"]), "properties": properties,
            "methods": sorted(methods), "zeroes_connector_hit": flags}


def _token_buffer_bases(root: pathlib.Path) -> list[str]:
    """Bases of every ``class TokenBuffer`` in ``vllm/v1/token_buffer.py`` (0.34: ``list[int]``
    for type checkers, ``array`` at run time: ``Request.prompt_token_ids`` is an int32
    ``array``), or ``[]`` where there is no such file."""
    path = root / FILES["token_buffer"]
    if not path.exists():
        return []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [ast.unparse(b) for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "TokenBuffer"
            for b in n.bases]


def _uses(fn: ast.AST, methods: dict[str, str]):
    """``(name, receiver text)`` of each call of a method (each read of a property) in ``fn``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if methods.get(node.func.attr, "property") != "property":
                yield node.func.attr, ast.unparse(node.func.value)
        elif isinstance(node, ast.Attribute) and methods.get(node.attr) == "property":
            yield node.attr, ast.unparse(node.value)


def _callers(root: pathlib.Path, methods: dict[str, str]) -> dict[str, list[str]]:
    """``{method: ["vllm/...py:Qualified.function", ...]}`` over :data:`CALLER_DIRS`;
    ``methods`` maps each name to its kind (a property counts where it is read)."""
    out: dict[str, set[str]] = {}
    for folder in CALLER_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(CONNECTOR_DIR) and rel not in CALLER_KEEP:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for qualname, fn in _functions(tree).items():
                for name, receiver in _uses(fn, methods):
                    if NOT_KV_RECEIVER.search(receiver):
                        continue
                    if RECEIVER.search(receiver) or (rel == FILES["base"] and receiver in ("self", "cls")):
                        out.setdefault(name, set()).add(f"{rel}:{qualname}")
    return {name: sorted(where) for name, where in sorted(out.items())}


def _version(root: pathlib.Path) -> str:
    tree = ast.parse((root / "vllm/_version.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            value = node.value
            while isinstance(value, ast.Assign):  # __version__ = version = '...'
                value = value.value
            return _string(value) or ""
    return ""


def _wheel_info(wheel: pathlib.Path) -> dict:
    digest = hashlib.sha256()
    with wheel.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    requires_torch = ""
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is not None:
            for line in z.read(meta).decode().splitlines():
                if line.startswith("Requires-Dist: torch=="):
                    requires_torch = line.removeprefix("Requires-Dist: ")
    return {"wheel": wheel.name, "sha256": digest.hexdigest(), "requires": requires_torch}


def extract(root: str | pathlib.Path, wheel: str | pathlib.Path | None = None) -> dict:
    """The API description of the ``vllm`` package under ``root`` (see the module docstring).

    Raises:
        FileNotFoundError: ``root`` holds no ``vllm`` package (or one without these files).
        KeyError: a class or function this script expects is gone from the source (a new
            vLLM moved it: update :data:`CLASSES`/:data:`FILES`).
    """
    root = pathlib.Path(root)
    trees = {key: ast.parse((root / rel).read_text(encoding="utf-8")) for key, rel in FILES.items()
             if key not in OPTIONAL_FILES}
    classes = {}
    for name, key in CLASSES.items():
        node = next((n for n in trees[key].body if isinstance(n, ast.ClassDef) and n.name == name), None)
        if node is None and name in OPTIONAL_CLASSES:
            continue
        if node is None:
            raise KeyError(f"class {name} not found in {FILES[key]}")
        classes[name] = _class(node)
    exported = next(ast.literal_eval(n.value) for n in trees["v1_init"].body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "__all__" for t in n.targets))
    methods = {name: m["kind"] for cls in ("KVConnectorBase_V1", "SupportsHMA")
               for name, m in classes[cls]["methods"].items()}
    source = _wheel_info(pathlib.Path(wheel)) if wheel else {"wheel": None, "sha256": None, "requires": None}
    return {
        "vllm_version": _version(root),
        **source,
        "files": {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() if (root / rel).exists() else None
                  for rel in FILES.values()},
        "exported_from_kv_connector_v1": sorted(exported),
        "classes": classes,
        "factory": _factory_facts(trees["factory"]),
        "hma": _hma_facts(trees["base"], trees["vllm_config"]),
        "callers": _callers(root, methods),
        "request": _request_facts(trees["request"], trees["scheduler"]),
        "token_buffer_bases": _token_buffer_bases(root),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="directory holding the vllm package (unzipped wheel or site-packages)")
    p.add_argument("--wheel", help="the wheel ROOT was unzipped from (its name and sha256 are recorded)")
    p.add_argument("-o", "--output", help="JSON file to write (default: stdout)")
    args = p.parse_args(argv)
    text = json.dumps(extract(args.root, args.wheel), indent=1) + "\n"
    if args.output:
        pathlib.Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
