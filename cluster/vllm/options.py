"""What users set on the connector beyond our config: connector-only extra-config keys and
per-request ``kv_transfer_params``.

``kv_connector_extra_config`` holds our config's field names (:func:`cluster.config.load_config`
reads them) plus the connector-only keys of :data:`CONNECTOR_ONLY_KEYS`, which
:meth:`ConnectorOptions.pop_from` takes out and validates first:

* ``stats_path`` (str) — where :class:`cluster.vllm.events.EventLog` appends its JSON lines;
* ``store_tokens_per_step`` (int >= 1, default :data:`STORE_TOKENS_PER_STEP`) — tokens of
  canonical-KV compute per engine step (bounds the stall of a decode step);
* ``load_async`` (bool, default True) — blends take vLLM's async-load path;
* ``load_step_s`` (float seconds > 0, default :data:`LOAD_STEP_S`) — async blend work per
  engine step that also runs other requests;
* ``allow_request_overrides`` (bool, default False) — whether requests may set the keys of
  :data:`RESTRICTED_PARAMS`, which is every key of :data:`REQUEST_PARAMS` (issue 19: an API user
  turning storing, loading or recompute off changes the cache and the quality for everyone;
  issue 37: ``kvblend_load_async: false`` runs that request's blend synchronously inside the
  engine step, stalling every other request's step for the load, and ``kvblend_selection``
  changes the recompute cost; the Helm chart's ``vllm.allowRequestOverrides`` is off too).
  kvblend's own tests and benchmarks that send these keys turn it on.

Per request, ``SamplingParams(extra_args={"kv_transfer_params": {...}})`` (the OpenAI API's
``kv_transfer_params``) with the keys of :data:`REQUEST_PARAMS` (:func:`request_params` reads
them; unknown ``kvblend*`` keys are ignored, the first one with a warning; restricted keys
while overrides are off are ignored, counted ``ignored_overrides``, warned about once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blend.config import SELECTIONS, BlendConfig

#: kv_connector_extra_config keys that are not config fields.
CONNECTOR_ONLY_KEYS = ("stats_path", "store_tokens_per_step", "load_async", "load_step_s",
                       "allow_request_overrides")
#: per-request kv_transfer_params understood by the connector.
REQUEST_PARAMS = ("kvblend_load", "kvblend_blend", "kvblend_recompute_ratio", "kvblend_store",
                  "kvblend_load_async", "kvblend_selection")
#: request keys honoured only with ``allow_request_overrides``: all of them (issue 37).
RESTRICTED_PARAMS = REQUEST_PARAMS
#: default tokens of canonical-KV compute per engine step (bounds the stall of a decode step).
STORE_TOKENS_PER_STEP = 512
#: default seconds of async blend work per engine step that also runs other requests.
LOAD_STEP_S = 0.1


@dataclass(frozen=True)
class ConnectorOptions:
    """The connector-only keys of ``kv_connector_extra_config`` (see the module docstring)."""

    stats_path: str | None = None
    store_tokens_per_step: int = STORE_TOKENS_PER_STEP
    load_async: bool = True
    load_step_s: float = LOAD_STEP_S
    allow_request_overrides: bool = False

    @classmethod
    def pop_from(cls, extra: dict[str, Any]) -> ConnectorOptions:
        """Take the connector-only keys out of ``extra`` (what remains is config overrides).

        Raises:
            ValueError: a malformed value, naming the key and the value.
        """
        stats_path = extra.pop("stats_path", None)
        store_tokens_per_step = int(extra.pop("store_tokens_per_step", STORE_TOKENS_PER_STEP))
        if store_tokens_per_step < 1:
            raise ValueError(f"kv_connector_extra_config store_tokens_per_step="
                             f"{store_tokens_per_step}: must be >= 1")
        load_async = extra.pop("load_async", True)
        if not isinstance(load_async, bool):
            raise ValueError(f"kv_connector_extra_config load_async={load_async!r}: must be true or false")
        load_step_s = float(extra.pop("load_step_s", LOAD_STEP_S))
        if not load_step_s > 0:
            raise ValueError(f"kv_connector_extra_config load_step_s={load_step_s}: must be > 0 seconds")
        allow = extra.pop("allow_request_overrides", False)
        if not isinstance(allow, bool):
            raise ValueError(f"kv_connector_extra_config allow_request_overrides={allow!r}: must be true or false")
        return cls(stats_path, store_tokens_per_step, load_async, load_step_s, allow)


def request_params(request, warn: Callable[..., None], allow_overrides: bool = False,
                   ignored: list[str] | None = None) -> dict[str, Any]:
    """The :data:`REQUEST_PARAMS` of ``request.kv_transfer_params`` (vLLM copies them from
    ``SamplingParams.extra_args["kv_transfer_params"]``); other ``kvblend*`` keys are
    ignored, the first one reported through ``warn(what, msg, *args)``; other keys are
    ignored silently (they may be another connector's). Without ``allow_overrides`` (the
    default) the :data:`RESTRICTED_PARAMS` are left out too, appended to ``ignored`` (when
    given), the first one reported through ``warn``."""
    params = dict(getattr(request, "kv_transfer_params", None) or {})
    out = {}
    for k, v in params.items():
        if k in RESTRICTED_PARAMS and not allow_overrides:
            if ignored is not None:
                ignored.append(k)
            warn("param:restricted", "kvblend: kv_transfer_params key %r ignored: request overrides of %s are "
                 "off (allow_request_overrides; counted ignored_overrides, warned once)", k,
                 ", ".join(RESTRICTED_PARAMS))
        elif k in REQUEST_PARAMS:
            out[k] = v
        elif k.startswith("kvblend"):
            # one kind for every unknown key: request keys are user input, and a kind per key
            # would grow the warned set with every new name a client sends
            warn("param:unknown", "kvblend: unknown kv_transfer_params key %r ignored (known: %s; "
                 "later unknown keys are ignored silently)", k, ", ".join(REQUEST_PARAMS))
    return out


def request_blend_config(blend_cfg: BlendConfig, params: dict[str, Any]) -> BlendConfig:
    """``blend_cfg`` (the config's blend section) with a request's ``kvblend_recompute_ratio``,
    ``kvblend_selection`` and ``kvblend_blend`` (:func:`request_params`) applied.

    Raises:
        ValueError: a ratio outside ``[0, 1]`` or an unknown selection.
    """
    if "kvblend_selection" in params:
        selection = params["kvblend_selection"]
        if selection not in SELECTIONS:
            raise ValueError(f"kvblend_selection={selection!r}: choose one of {', '.join(SELECTIONS)}")
        blend_cfg = dataclasses.replace(blend_cfg, selection=selection)
    if "kvblend_recompute_ratio" in params:
        ratio = float(params["kvblend_recompute_ratio"])
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"kvblend_recompute_ratio={ratio} outside 0..1")
        blend_cfg = dataclasses.replace(blend_cfg, recompute_ratios=(ratio,))
    if not params.get("kvblend_blend", True):
        blend_cfg = dataclasses.replace(blend_cfg, enable_blending=False)
    return blend_cfg
