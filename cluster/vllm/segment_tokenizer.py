"""Segment-wise tokenization in vLLM's front end: ``vllm serve ... --tokenizer-mode kvblend``.

A blend prompt sent as one string, ``system ⟨sep⟩ passage ⟨sep⟩ ... ⟨sep⟩ question``, is
tokenized by vLLM as a whole, and byte-level BPE merges a separator's edge with the text
beside it: with LMCache's ``" # # "`` the trailing space joins the next passage's first word
(``" Hello"`` instead of ``"Hello"``), so a passage gets other ids than when it was sent or
ingested alone, its segment key differs, and it misses (most passages, measured in
:mod:`blend.segments`). With this mode each piece between separators is tokenized on its own and
the pieces are joined with the separator's own ids::

    text  "sys # # passage A # # question"
    ids   encode(sys) + encode(" # # ") + encode(passage A) + encode(" # # ") + encode(question)
          (+ the BOS/EOS the tokenizer adds, around the whole; the pieces are encoded without)

so a passage has exactly the ids of ``encode(passage, add_special_tokens=False)`` — the ids a
passage sent alone has after its BOS, the ids ``kvblend ingest`` stores — wherever it sits.
Text without the separator is tokenized exactly as in vLLM's ``hf`` mode.

How it plugs in (public vLLM registries, no patch): :func:`register` adds the tokenizer mode
``kvblend`` — vLLM's cached HF tokenizer (``vllm.tokenizers.hf.CachedHfTokenizer``) and
:class:`SegmentRenderer`, vLLM's ``HfRenderer`` whose tokenizer is wrapped by
:func:`segment_aware`. Completions (``tokenizer(prompt)``) and chat completions (the chat
template's text goes through the same ``tokenizer(...)`` call) both take it. The separator is
the effective ``blend_separator`` (:func:`separator_for`: YAML, ``LMCACHE_BLEND_SPECIAL_STR`` /
``KVBLEND_BLEND_SEPARATOR``, then the connector's ``kv_connector_extra_config``), read once
when the renderer starts. vLLM must call :func:`register` in every process (front end and
engine core) before it loads a tokenizer: the ``kvblend`` general plugin does
(:mod:`cluster.vllm.plugin`).

Not segment-wise (tokenized as in ``hf`` mode, so a passage there may miss): text pairs,
batches, padding or tensors asked of the tokenizer, and a prompt whose segment-wise ids pass
``max_length`` when truncation is asked (vLLM's length check then rejects or truncates it as
usual).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from vllm.renderers.hf import HfRenderer

from blend.segments import special_tokens_around

log = logging.getLogger("kvblend.segment_tokenizer")

#: ``--tokenizer-mode`` value that turns segment-wise tokenization on.
TOKENIZER_MODE = "kvblend"

#: keyword arguments of ``tokenizer(text, ...)`` the segment-wise path honours; any other one
#: (text pairs, tensors, overflow, ...) is tokenized the ``hf`` way.
_PLAIN_KWARGS = frozenset({"add_special_tokens", "truncation", "max_length", "padding",
                           "return_offsets_mapping", "return_tensors", "return_attention_mask"})

#: ``piece -> (ids, offsets or None)``: one separator-free piece, without special tokens.
EncodePiece = Callable[[str, bool], tuple[list[int], list[tuple[int, int]] | None]]


def encode_segment_wise(encode: EncodePiece, text: str, separator: str,
                        specials: tuple[Sequence[int], Sequence[int]], *, add_special_tokens: bool = True,
                        want_offsets: bool = False) -> tuple[list[int], list[tuple[int, int]] | None] | None:
    """Ids (and character offsets) of ``text`` tokenized piece by piece between separators.

    Args:
        encode: encodes one piece without special tokens (offsets when asked).
        text: the prompt.
        separator: the blend separator (non-empty).
        specials: ``(before, after)`` ids the tokenizer adds around a text
            (:func:`blend.segments.special_tokens_around`), added when ``add_special_tokens``.
        want_offsets: also return one ``(start, end)`` character span per id (``(0, 0)`` for
            the special ids, as fast tokenizers give them).

    Returns:
        ``(ids, offsets or None)``, or None when ``text`` holds no separator (tokenize it whole).

    Raises:
        ValueError: empty separator.
    """
    if not separator:
        raise ValueError("separator='' is not allowed")
    if not isinstance(text, str) or separator not in text:
        return None
    before, after = (tuple(specials[0]), tuple(specials[1])) if add_special_tokens else ((), ())
    ids: list[int] = list(before)
    offsets: list[tuple[int, int]] = [(0, 0)] * len(before)
    sep_ids, sep_offsets = encode(separator, want_offsets)
    at = 0
    for i, piece in enumerate(text.split(separator)):
        if i:
            ids += sep_ids
            if want_offsets:
                offsets += [(at + s, at + e) for s, e in sep_offsets or ()]
            at += len(separator)
        if piece:
            piece_ids, piece_offsets = encode(piece, want_offsets)
            ids += piece_ids
            if want_offsets:
                offsets += [(at + s, at + e) for s, e in piece_offsets or ()]
            at += len(piece)
    ids += after
    offsets += [(0, 0)] * len(after)
    return ids, (offsets if want_offsets else None)


class _SegmentWise:
    """Mixin over a HF tokenizer's class (see :func:`segment_aware`): ``__call__`` and
    ``encode`` of one string holding the separator are segment-wise."""

    _kvblend_separator: str
    _kvblend_specials: tuple[tuple[int, ...], tuple[int, ...]]
    _kvblend_inner: Any

    def _kvblend_piece(self, piece: str, want_offsets: bool):
        enc = super().__call__(piece, add_special_tokens=False, return_offsets_mapping=want_offsets)
        return list(enc["input_ids"]), ([tuple(o) for o in enc["offset_mapping"]] if want_offsets else None)

    def _kvblend_ids(self, text, kwargs: dict[str, Any]):
        """``(ids, offsets)`` when this call can be segment-wise, else None."""
        if (not isinstance(text, str) or self._kvblend_separator not in text or set(kwargs) - _PLAIN_KWARGS
                or kwargs.get("padding") not in (None, False, "do_not_pad") or kwargs.get("return_tensors")):
            return None
        got = encode_segment_wise(self._kvblend_piece, text, self._kvblend_separator, self._kvblend_specials,
                                  add_special_tokens=kwargs.get("add_special_tokens", True),
                                  want_offsets=bool(kwargs.get("return_offsets_mapping")))
        max_length = kwargs.get("max_length")
        if got is None or (kwargs.get("truncation") and max_length is not None and len(got[0]) > max_length):
            return None
        return got

    def __call__(self, text=None, *args, **kwargs):
        got = None if args else self._kvblend_ids(text, kwargs)
        if got is None:
            return super().__call__(text, *args, **kwargs)
        from transformers import BatchEncoding

        ids, offsets = got
        data: dict[str, Any] = {"input_ids": ids}
        if kwargs.get("return_attention_mask", True) is not False:
            data["attention_mask"] = [1] * len(ids)
        if offsets is not None:
            data["offset_mapping"] = offsets
        return BatchEncoding(data)

    def encode(self, text, text_pair=None, add_special_tokens: bool = True, **kwargs):
        got = None if text_pair is not None else self._kvblend_ids(
            text, {**kwargs, "add_special_tokens": add_special_tokens})
        if got is None:
            return super().encode(text, text_pair=text_pair, add_special_tokens=add_special_tokens, **kwargs)
        return got[0]

    def __reduce__(self):
        return segment_aware, (self._kvblend_inner, self._kvblend_separator)


def segment_aware(tokenizer, separator: str):
    """A shallow copy of the HF ``tokenizer`` whose ``tokenizer(text)`` and ``encode(text)`` are
    segment-wise (:func:`encode_segment_wise`) for text holding ``separator``; everything else
    (decode, vocabulary, chat templates, vLLM's cached properties) is the tokenizer's own.
    Survives ``copy``/``deepcopy``/pickling (vLLM's tokenizer pool copies it).

    Raises:
        ValueError: empty separator.
    """
    import copy

    if not separator:
        raise ValueError("separator='' is not allowed")
    base = type(tokenizer)
    wrapped = copy.copy(tokenizer)
    wrapped.__class__ = type(f"SegmentWise{base.__name__}", (_SegmentWise, base), {})
    wrapped._kvblend_separator = separator
    wrapped._kvblend_specials = special_tokens_around(tokenizer)
    wrapped._kvblend_inner = tokenizer
    return wrapped


def separator_for(vllm_config) -> str:
    """The effective ``blend_separator`` of a vLLM config: :func:`cluster.config.load_config` with
    the connector's ``kv_connector_extra_config`` (when set) as the highest-precedence overrides,
    as the connector itself reads it.

    Raises:
        ValueError: a malformed config value (start-up stops, naming it).
    """
    from cluster.config import load_config
    from cluster.vllm.options import ConnectorOptions

    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    ConnectorOptions.pop_from(extra)
    return load_config(overrides=extra, overrides_origin="kv_connector_extra_config").blend.blend_separator


class SegmentRenderer(HfRenderer):
    """vLLM's ``HfRenderer`` over a :func:`segment_aware` tokenizer (tokenizer mode ``kvblend``).

    Built by vLLM's ``renderer_from_config`` in the front end (API server / ``LLM``), once.
    """

    def __init__(self, config, tokenizer) -> None:
        if tokenizer is not None:
            separator = separator_for(config)
            tokenizer = segment_aware(tokenizer, separator)
            log.info("kvblend: prompts holding the separator %r are tokenized segment by segment "
                     "(--tokenizer-mode %s)", separator, TOKENIZER_MODE)
        super().__init__(config, tokenizer)


def register() -> None:
    """Register tokenizer mode ``kvblend`` with vLLM's tokenizer and renderer registries
    (idempotent; call it in every vLLM process before a tokenizer is loaded)."""
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers import TokenizerRegistry

    if TOKENIZER_MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(TOKENIZER_MODE, "vllm.tokenizers.hf", "CachedHfTokenizer")
    if TOKENIZER_MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(TOKENIZER_MODE, __name__, "SegmentRenderer")
