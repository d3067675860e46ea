"""KVBlendConnector against vLLM's KV connector API, of the installed 0.32, of 0.33 and of 0.34.

vLLM 0.33.0 and 0.34.0 are CUDA builds pinning torch 2.14, which cannot be imported here: their
API is read from the wheels' source by ``tests/vllm/extract_api.py`` (``ast``) into
``vllm_0_33_api.json`` and ``vllm_0_34_api.json``; 0.32's is read the same way from the installed
package, so all three are compared alike (:mod:`tests.vllm.shapes`). Each check runs against
every version:

* every abstract method of ``KVConnectorBase_V1`` is ours, and every method we override keeps
  vLLM's signature (kind, positional parameter names and order, defaults, ``**kwargs``);
* the constructor takes what ``KVConnectorFactory`` passes, and the factory loads us from
  ``kv_connector_module_path`` (run for real on 0.32; 0.33's and 0.34's loading code reads the
  same);
* ``docs/vllm-versions.md``'s hook table lists every hook of every version, says which exist
  and which are abstract in each, and what kvblend does: ``implements`` and ``adopts`` hooks
  must be overridden by the connector, ``inherits`` hooks must not be. An ``adopts`` hook is
  one whose vLLM default is wrong or missing for kvblend; its implementation is a mixin of
  :mod:`cluster.vllm.compat`, and :func:`test_adopted_hooks_are_implemented` names any the
  connector does not mix in.

The compat shims themselves are tested at the end, with stand-ins for the connector's halves;
the scheduler half on each version's own scheduler shapes is in
``tests/cluster/vllm/test_vllm_shapes.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import json
import pathlib
import re
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cluster.vllm import compat
from cluster.vllm.connector import KVBlendConnector
from cluster.vllm.metrics import KVBlendConnectorStats, KVBlendPromMetrics
from tests.vllm.shapes import API_FILES, VERSIONS, api

pytestmark = pytest.mark.unit

HERE = pathlib.Path(__file__).resolve().parent
DOC = HERE.parents[1] / "docs" / "vllm-versions.md"
OUR_PACKAGES = ("cluster", "blend", "tiers")
HOOK_CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
DECISIONS = ("implements", "adopts", "inherits")
POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
#: what KVConnectorFactory needs of a connector loaded from kv_connector_module_path
LOADING_FACTS = ("module_path_import", "class_lookup", "required_constructor_keywords", "constructor_call")


def hooks(version: str) -> dict[str, tuple[str, dict]]:
    """Public methods of the base class and SupportsHMA: ``{name: (class, method)}``."""
    return {name: (cls, m) for cls in HOOK_CLASSES
            for name, m in api(version)["classes"][cls]["methods"].items() if not name.startswith("_")}


@functools.cache
def doc_table() -> dict[str, list[str]]:
    """``{hook: [one cell per version of VERSIONS, kvblend cell]}`` from the doc's hook table."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Hook table", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[0]) if line.startswith("|") else None
        if match:
            assert len(cells) == len(VERSIONS) + 2, (f"doc row for {match[1]} has {len(cells)} cells, "
                                                    f"not {len(VERSIONS) + 2}")
            assert match[1] not in rows, f"doc lists {match[1]} twice"
            rows[match[1]] = cells[1:]
    return rows


def decision(hook: str) -> str:
    word = re.sub(r"[^a-z]", "", doc_table()[hook][-1].split()[0].lower())
    assert word in DECISIONS, f"doc: {hook}'s kvblend cell must start with one of {DECISIONS}"
    return word


def definer(cls: type, name: str) -> type | None:
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def is_ours(cls: type, name: str) -> bool:
    """Whether ``cls`` gets ``name`` from our code (connector, halves, compat mixins)."""
    owner = definer(cls, name)
    return owner is not None and owner.__module__.split(".")[0] in OUR_PACKAGES


def our_kind_and_params(cls: type, name: str) -> tuple[str, list[inspect.Parameter]]:
    """``(kind, parameters without self/cls)`` of ``cls.name`` as defined in our class."""
    obj = vars(definer(cls, name))[name]
    if isinstance(obj, property):
        kind, fn = "property", obj.fget
    elif isinstance(obj, classmethod):
        kind, fn = "classmethod", obj.__func__
    elif isinstance(obj, staticmethod):
        return "staticmethod", list(inspect.signature(obj.__func__).parameters.values())
    else:
        kind, fn = "method", obj
    return kind, list(inspect.signature(fn).parameters.values())[1:]


def signature_problems(cls: type, name: str, spec: dict) -> list[str]:
    """Ways ``cls.name`` (ours) cannot stand in for vLLM's method ``spec``; empty when it can."""
    kind, ours = our_kind_and_params(cls, name)
    if kind != spec["kind"]:
        return [f"{name}: a {kind}, vLLM's is a {spec['kind']}"]
    theirs = spec["params"] if kind == "staticmethod" else spec["params"][1:]
    problems = []
    their_pos = [p for p in theirs if p["kind"] in POSITIONAL]
    our_pos = [p for p in ours if p.kind.name in POSITIONAL]
    if [p.name for p in our_pos[:len(their_pos)]] != [p["name"] for p in their_pos]:
        problems.append(f"{name}: positional parameters {[p.name for p in our_pos]}, "
                        f"vLLM passes {[p['name'] for p in their_pos]}")
    problems += [f"{name}: extra parameter {p.name} has no default" for p in our_pos[len(their_pos):]
                 if p.default is inspect.Parameter.empty]
    by_name = {p.name: p for p in ours}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours)
    for p in theirs:
        mine = by_name.get(p["name"])
        if p["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if not any(q.kind.name == p["kind"] for q in ours):
                problems.append(f"{name}: vLLM's takes {'*' if p['kind'] == 'VAR_POSITIONAL' else '**'}"
                                f"{p['name']}, ours does not")
        elif mine is None and not (p["kind"] == "KEYWORD_ONLY" and var_kw):
            problems.append(f"{name}: no parameter {p['name']}")
        elif mine is not None and p["default"] is not None and mine.default is inspect.Parameter.empty:
            problems.append(f"{name}: {p['name']} has a default in vLLM ({p['default']}), none in ours")
    problems += [f"{name}: keyword-only {p.name} has no default" for p in ours
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
                 and p.name not in {q["name"] for q in theirs}]
    return problems


# ================================================================ the connector, per version


@pytest.mark.parametrize("version", VERSIONS)
def test_abstract_methods_are_implemented(version):
    abstract = [name for name, (cls, m) in hooks(version).items() if cls == "KVConnectorBase_V1" and m["abstract"]]
    assert abstract, "no abstract method found: extract_api.py no longer reads the base class"
    missing = [name for name in abstract if not is_ours(KVBlendConnector, name)]
    assert not missing, f"vLLM {version}: KVBlendConnector does not implement abstract {missing}"
    assert not KVBlendConnector.__abstractmethods__  # and, for the installed 0.32, Python agrees


@pytest.mark.parametrize("version", VERSIONS)
def test_overrides_keep_vllms_signatures(version):
    overridden = [name for name in hooks(version) if is_ours(KVBlendConnector, name)]
    problems = [p for name in overridden for p in signature_problems(KVBlendConnector, name, hooks(version)[name][1])]
    assert not problems, f"vLLM {version}:\n" + "\n".join(problems)


@pytest.mark.parametrize("version", VERSIONS)
def test_constructor_takes_what_the_factory_passes(version):
    factory = api(version)["factory"]
    call = ast.parse(factory["constructor_call"], mode="eval")
    args = [a.id for a in call.body.args]
    assert args == ["config", "role", "kv_cache_config"] and not call.body.keywords
    theirs = [p["name"] for p in api(version)["classes"]["KVConnectorBase_V1"]["methods"]["__init__"]["params"][1:]]
    ours = list(inspect.signature(KVBlendConnector.__init__).parameters)[1:]
    assert ours[:len(theirs)] == theirs == ["vllm_config", "role", "kv_cache_config"]
    inspect.signature(KVBlendConnector).bind(*args)  # positionally, as create_connector calls it
    assert set(factory["required_constructor_keywords"]) <= set(ours)


def test_factory_loads_us_from_the_module_path():
    """Run 0.32's own loading code; 0.33's and 0.34's are the same (the facts extract_api.py
    reads match: 0.34 adds NixlConnector's transfer_mode and the kv_cache_access classmethod,
    which asks the class it loaded the same way)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for version in VERSIONS[1:]:
        assert {k: api(version)["factory"][k] for k in LOADING_FACTS} == \
            {k: api("0.32")["factory"][k] for k in LOADING_FACTS}, f"vLLM {version} loads connectors otherwise"
    for module_path in ("cluster.connector", "cluster.vllm.connector"):
        config = KVTransferConfig(kv_connector="KVBlendConnector", kv_connector_module_path=module_path,
                                  kv_role="kv_both")
        assert KVConnectorFactory.get_connector_class(config) is KVBlendConnector


@pytest.mark.parametrize("version", VERSIONS)
def test_metrics_classes_implement_what_vllm_leaves_unimplemented(version):
    for ours, base in ((KVBlendConnectorStats, "KVConnectorStats"), (KVBlendPromMetrics, "KVConnectorPromMetrics")):
        methods = api(version)["classes"][base]["methods"]
        todo = [n for n, m in methods.items() if (m["abstract"] or m["raises_not_implemented"]) and n != "__init__"]
        missing = [n for n in todo if not is_ours(ours, n)]
        assert not missing, f"vLLM {version}: {ours.__name__} lacks {missing}"
        problems = [p for n, m in methods.items() if n != "__init__" and is_ours(ours, n)
                    for p in signature_problems(ours, n, m)]
        assert not problems, f"vLLM {version}:\n" + "\n".join(problems)


# ================================================================ the doc's hook table


def test_doc_table_lists_every_hook_of_every_version():
    known = set().union(*(hooks(v) for v in VERSIONS))
    rows = set(doc_table())
    assert not known - rows, f"{DOC.name} lacks rows for {sorted(known - rows)}"
    assert not rows - known, f"{DOC.name} lists hooks no version has: {sorted(rows - known)}"


@pytest.mark.parametrize("version", VERSIONS)
def test_doc_table_says_which_hooks_exist_and_are_abstract(version):
    column = VERSIONS.index(version)
    wrong = []
    for hook, cells in doc_table().items():
        cell, found = cells[column], hooks(version).get(hook)
        absent = cell in ("—", "-", "")
        if found is None and not absent or found is not None and absent:
            wrong.append(f"{hook}: '{cell}' but it is {'absent' if found is None else 'present'}")
        elif found is not None and ("abstract" in cell.lower()) != found[1]["abstract"]:
            wrong.append(f"{hook}: '{cell}' but abstract={found[1]['abstract']}")
    assert not wrong, f"{DOC.name}, column {version}:\n" + "\n".join(wrong)


def test_doc_implements_and_inherits_match_the_connector():
    wrong = []
    for hook in doc_table():
        word, ours = decision(hook), is_ours(KVBlendConnector, hook)
        if word == "implements" and not ours:
            wrong.append(f"{hook}: the doc says kvblend implements it; KVBlendConnector inherits vLLM's")
        if word == "inherits" and ours:
            wrong.append(f"{hook}: the doc says kvblend inherits vLLM's; KVBlendConnector overrides it")
    hma = issubclass(KVBlendConnector, SupportsHMA)
    if hma != (decision("request_finished_all_groups") != "inherits"):
        wrong.append(f"request_finished_all_groups: KVBlendConnector is{'' if hma else ' not'} SupportsHMA")
    assert not wrong, "\n".join(wrong)


def test_adopted_hooks_are_implemented():
    """The hooks the doc marks ``adopts`` are the connector's (mixed in from compat)."""
    missing = [hook for hook in doc_table() if decision(hook) == "adopts" and not is_ours(KVBlendConnector, hook)]
    assert not missing, (f"KVBlendConnector lacks {missing}: mix in cluster.vllm.compat's "
                         f"KVBlendHooksMixin / KVBlendHMAMixin ({DOC.relative_to(HERE.parents[1])}, 'Summary')")


def test_doc_names_the_wheels_and_quotes_vllms_hma_warning():
    text = " ".join(DOC.read_text(encoding="utf-8").split())
    for version in API_FILES:
        extracted = api(version)
        assert extracted["vllm_version"] == f"{version}.0", f"{API_FILES[version].name} is {extracted['vllm_version']}"
        assert extracted["wheel"] in text and extracted["sha256"] in text, f"{DOC.name} does not name the {version} wheel"
    for version in VERSIONS:
        warning = " ".join(api(version)["hma"]["startup_warning"][0].split())
        assert warning in text, f"{DOC.name} does not quote vLLM {version}'s HMA start-up warning"
        assert api(version)["hma"]["supports_hma_returns"][0] == "issubclass(connector, SupportsHMA)"


# ================================================================ cluster.vllm.compat


def test_cache_hit_sources_split_the_claim_by_tier():
    # | sys 0-8 | sep 8-10 | A 10-40 host | sep 40-42 | B 42-74 disk | sep 74-76 | C 76-90 redis | query
    hits = [(10, 40, "host"), (42, 74, "disk"), (76, 90, "redis")]
    assert compat.cache_hit_sources(0, 90, hits) == {
        CacheHitSource.HOST: 30, CacheHitSource.DISK: 32,
        CacheHitSource.EXTERNAL_UNSPECIFIED: 10 + 2 + 2 + 14}
    # vLLM's local prefix cache covered [0, 16) and vLLM kept 40 of the claimed tokens
    assert compat.cache_hit_sources(16, 40, hits) == {CacheHitSource.HOST: 24, CacheHitSource.DISK: 14,
                                                      CacheHitSource.EXTERNAL_UNSPECIFIED: 2}
    assert compat.cache_hit_sources(0, 0, hits) == {}
    with pytest.raises(ValueError):
        compat.cache_hit_sources(0, 10, [(0, 8, "host"), (4, 10, "disk")])


class _Scheduler:
    """The two methods of the scheduler half the mixin calls (docs/vllm-versions.md)."""

    def __init__(self, hits=None) -> None:
        self.hits, self.forgotten = hits, 0

    def cache_hits(self, request_id):
        if self.hits is None:
            raise KeyError(request_id)
        return self.hits

    def forget_stored_keys(self):
        self.forgotten += 1

    def may_load_async(self, request):
        if self.hits is None:
            raise ValueError("token id outside the vocabulary")
        return request.request_id == "blend"


class _Client:
    def __init__(self) -> None:
        self.cleared = []

    def clear(self, namespace):
        self.cleared.append(namespace)
        return 3


class _Hooked(compat.KVBlendHooksMixin, KVConnectorBase_V1):
    """Enough of KVBlendConnector for the mixin (no vLLM config)."""

    def __init__(self, scheduler, client, enabled=True) -> None:  # noqa: D107 - no super(): no VllmConfig
        self.connector_scheduler, self.client, self.enabled = scheduler, client, enabled
        self.namespace_digest = "0123456789abcdef"

    start_load_kv = wait_for_layer_load = save_kv_layer = wait_for_save = None
    get_num_new_matched_tokens = update_state_after_alloc = build_connector_meta = None


def test_hooks_mixin_overrides_vllms_defaults():
    request = SimpleNamespace(request_id="r1")
    hooked = _Hooked(_Scheduler((0, [(10, 40, "host")])), _Client())
    assert hooked.requires_kv_delivery is False
    assert hooked.get_external_cache_hit_sources(request, 40) == {CacheHitSource.HOST: 30,
                                                                  CacheHitSource.EXTERNAL_UNSPECIFIED: 10}
    assert hooked.get_external_cache_hit_sources(request, 0) == {}
    broken = _Hooked(_Scheduler(None), _Client())  # a lookup it cannot answer: vLLM's default
    assert broken.get_external_cache_hit_sources(request, 7) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 7}


def test_may_load_async_asks_the_scheduler_half_and_never_raises():
    blend, plain = SimpleNamespace(request_id="blend"), SimpleNamespace(request_id="plain")
    hooked = _Hooked(_Scheduler((0, [])), _Client())
    assert hooked.may_load_async(blend) is True and hooked.may_load_async(plain) is False
    assert _Hooked(_Scheduler(None), _Client()).may_load_async(blend) is False   # the half raised
    assert _Hooked(None, None).may_load_async(blend) is False                    # worker role
    assert _Hooked(_Scheduler((0, [])), _Client(), enabled=False).may_load_async(blend) is False


def test_reset_cache_clears_our_namespaces_and_never_answers_false():
    hooked = _Hooked(_Scheduler(), _Client())
    assert hooked.reset_cache() is True
    assert hooked.client.cleared == ["0123456789abcdef"] and hooked.connector_scheduler.forgotten == 1
    under_tp = _Hooked(_Scheduler(), SimpleNamespace(digests=["a", "b"], clear=lambda ns: 1))
    assert under_tp.reset_cache() is True
    assert _Hooked(_Scheduler(), SimpleNamespace()).reset_cache() is None        # a client without clear
    assert _Hooked(_Scheduler(), SimpleNamespace(clear=lambda ns: 1 / 0)).reset_cache() is None
    assert _Hooked(None, None, enabled=False).reset_cache() is True               # idle / worker role


class _Tier:
    """A tier that lists its keys (host, disk), as ``LocalCacheClient.tier``."""

    def __init__(self, keys) -> None:
        self._keys = list(keys)

    def keys(self):
        return list(self._keys)


class _LocalClient:
    """The machine-local client: a tier, ``delete``, no ``clear``."""

    def __init__(self, keys) -> None:
        self.tier = _Tier(keys)

    def delete(self, keys):
        keys = set(keys)
        present = [k for k in self.tier._keys if k in keys]
        self.tier._keys = [k for k in self.tier._keys if k not in keys]
        return len(present)


def test_clear_namespaces_reaches_the_local_and_agent_clients():
    from tiers.keys import segment_key

    ours, theirs = segment_key("0123456789abcdef", [1, 2]), segment_key("feedfacefeedface", [1, 2])
    local = _LocalClient([ours, theirs])
    assert compat.clear_namespaces(local, ["0123456789abcdef"]) == 1 and local.tier.keys() == [theirs]
    assert compat.clear_namespaces(local, ["0123456789abcdef"]) == 0
    stack = SimpleNamespace(tier=SimpleNamespace(clear=lambda ns: 2))  # a TierStack clears by namespace
    assert compat.clear_namespaces(stack, ["a", "b"]) == 4
    fallback = _LocalClient([ours])
    agent_down = SimpleNamespace(fallback=fallback, up=False, delete=lambda keys: 0)
    assert compat.clear_namespaces(agent_down, ["0123456789abcdef"]) == 1 and fallback.tier.keys() == []
    fallback = _LocalClient([ours])
    agent_up = SimpleNamespace(fallback=fallback, up=True, delete=lambda keys: 0)
    assert compat.clear_namespaces(agent_up, ["0123456789abcdef"]) is None  # the shards are out of reach
    assert fallback.tier.keys() == []  # but the fallback's copies are gone
    assert compat.clear_namespaces(SimpleNamespace(delete=lambda keys: 0), ["x"]) is None


def test_skips_external_kv_reads_each_versions_flag():
    assert compat.skips_external_kv(SimpleNamespace(skip_reading_prefix_cache=True))      # 0.32, 0.33
    assert compat.skips_external_kv(SimpleNamespace(skip_reading_external_kv=True))       # 0.34
    assert not compat.skips_external_kv(SimpleNamespace(skip_reading_prefix_cache=False))
    assert not compat.skips_external_kv(SimpleNamespace(skip_reading_external_kv=False))
    assert not compat.skips_external_kv(SimpleNamespace())  # a request without either


def _model_config(window=None, layer_types=None, max_model_len=1024):
    text = SimpleNamespace(layer_types=layer_types) if layer_types is not None else SimpleNamespace()
    return SimpleNamespace(get_sliding_window=lambda: window, hf_text_config=text, max_model_len=max_model_len)


def test_refuse_unsupported_warns_once_per_engine(caplog):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    full, window = type("FullAttentionSpec", (), {})(), type("SlidingWindowSpec", (), {})()
    two = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=full), SimpleNamespace(kv_cache_spec=window)])
    one = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=full)])
    plain = _model_config()
    sched, worker = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER
    with caplog.at_level("WARNING", logger="kvblend.connector"):
        assert compat.refuse_unsupported(plain, two, sched) and compat.refuse_unsupported(plain, two, worker)
        assert not compat.refuse_unsupported(plain, one, sched) and not compat.refuse_unsupported(plain, None, worker)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "stays idle" in line and "--disable-hybrid-kv-cache-manager" in line


def test_sliding_window_shorter_than_the_model_is_refused():
    """Issue 21: a window below max_model_len is refused (whatever the KV cache groups); a
    window at least as long as the model, none, or a config whose layers are all full
    attention are served."""
    refusal = compat.sliding_window_refusal
    reason = refusal(_model_config(64))
    assert "sliding-window attention (window 64 tokens < max_model_len 1024)" in reason
    assert refusal(_model_config(64, ["full_attention", "sliding_attention"])) == reason
    assert refusal(_model_config([None, 128])) is not None  # a per-layer list: its shortest window
    assert refusal(_model_config(None)) is None
    assert refusal(_model_config(4096)) is None
    assert refusal(_model_config(1024)) is None
    assert refusal(_model_config(64, ["full_attention", "full_attention"])) is None
    # one group, as with --disable-hybrid-kv-cache-manager: still refused
    one = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=object())])
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    assert compat.refuse_unsupported(_model_config(64), one, KVConnectorRole.WORKER)


def test_handle_preemptions_is_a_documented_no_op():
    hooked = _Hooked(_Scheduler(), _Client())
    assert hooked.handle_preemptions(None) is None
    doc = compat.KVBlendHooksMixin.handle_preemptions.__doc__
    assert "WAITING_FOR_REMOTE_KVS" in doc and "RUNNING" in doc


class _Finisher(compat.KVBlendHMAMixin):
    def __init__(self, enabled=True) -> None:
        self.enabled, self.calls = enabled, []

    def request_finished(self, request, block_ids):
        self.calls.append(block_ids)
        return True, None


def test_hma_mixin_delegates_one_group_and_refuses_several():
    one = _Finisher()
    assert one.request_finished_all_groups("req", ([4, 5, 6],)) == (True, None) and one.calls == [[4, 5, 6]]
    with pytest.raises(RuntimeError, match="one KV cache group"):
        _Finisher().request_finished_all_groups("req", ([1], [2]))
    idle = _Finisher(enabled=False)  # an idle connector only forgets the request
    assert idle.request_finished_all_groups("req", ([1], [2])) == (True, None)
    assert issubclass(_Finisher, SupportsHMA)


def test_hybrid_refusal_names_the_flag():
    full, window = type("FullAttentionSpec", (), {})(), type("SlidingWindowSpec", (), {})()
    one = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=full)])
    two = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=full), SimpleNamespace(kv_cache_spec=window)])
    assert compat.hybrid_refusal(one) is None and compat.hybrid_refusal(None) is None
    reason = compat.hybrid_refusal(two)
    assert "FullAttentionSpec, SlidingWindowSpec" in reason and "--disable-hybrid-kv-cache-manager" in reason


def test_extract_api_runs_as_a_script(tmp_path):
    """The JSON is regenerated by the script (ROOT: an unzipped wheel or a site-packages)."""
    root = pathlib.Path(importlib.util.find_spec("vllm").submodule_search_locations[0]).parent
    out = tmp_path / "api.json"
    assert importlib.import_module("tests.vllm.extract_api").main([str(root), "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data)[:4] == ["vllm_version", "wheel", "sha256", "requires"]
    assert data["classes"] == api("0.32")["classes"]
