"""Chat prompts as blend prompts: the chat template's own text is a segment boundary.

A RAG client sends ``/v1/chat/completions`` with a system message and a user message holding
passages joined by the separator, then the question. vLLM renders the chat template into one
prompt (ChatML shown; every template has its own frame)::

    <|im_start|>system\\n SYS <|im_end|>\\n<|im_start|>user\\n A ⟨sep⟩ B ⟨sep⟩ Q <|im_end|>\\n<|im_start|>assistant\\n
    [ frame            ][sys][ frame                       ][A] sep [B] sep [ query                          ]

Split on the separator alone, the frame before the user message (role markers and the whole
system message) would be glued to passage A, whose ids would then never equal the ids
``kvblend ingest`` stored for it: a passage in first position would never hit (issue 35).
:func:`chat_frames` finds the template's frame texts once per tokenizer, by rendering a
conversation whose contents are sentinels and keeping what lies between them;
:func:`blend.segments.find_segments` then treats each frame like a separator (its tokens are
recomputed, never part of a chunk), so the system message and every passage are segments of
their own, in any position of any message. A frame that ends the prompt (the generation prompt)
belongs to the query, with the last segment before it.

Only frame texts holding a special token of the tokenizer (``<|im_start|>``, ``<|eot_id|>``,
...) are kept: a template framing messages with plain text (``"User: "``) would otherwise
split passages wherever that text occurs. Such templates get no frames (the first passage
then joins the frame's segment, as before). A template the conversation cannot be rendered
with (one refusing a system role is retried without it; one that raises for both) gives none.
Frames are derived from the tokenizer's own chat template: a ``--chat-template`` given to
``vllm serve`` instead is not seen here.

Bookkeeping only: no torch.
"""

from __future__ import annotations

import logging
import weakref

log = logging.getLogger(__name__)

#: sentinel contents; no whitespace at their edges, so templates that ``trim`` keep them
_SENTINELS = tuple(f"KVBLENDMSG{i}SENTINEL" for i in range(4))
_ROLES = ("system", "user", "assistant", "user")

_FRAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _special_texts(tokenizer) -> set[str]:
    """Texts of the tokenizer's special tokens (its named ones and added tokens marked special)."""
    out = {str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ()}
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(getattr(tok, "content", tok)))
    return {t for t in out if t}


def _render(tokenizer, first: int) -> str | None:
    """The chat template of ``tokenizer`` over messages ``first..`` of the sentinel conversation
    (with the generation prompt), or None when it cannot render them."""
    messages = [{"role": r, "content": s} for r, s in zip(_ROLES[first:], _SENTINELS[first:], strict=True)]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - templates raise what they like (no system role, ...)
        log.debug("chat template cannot render %s: %s", [m["role"] for m in messages], e)
        return None
    return text if isinstance(text, str) and all(s in text for s in _SENTINELS[first:]) else None


def frames_of(rendered: str, sentinels: tuple[str, ...], specials: set[str]) -> list[str]:
    """The texts between (and around) ``sentinels`` in ``rendered`` that hold a special token's
    text, in order of appearance, without repeats."""
    pieces = [rendered]
    for s in sentinels:
        last = pieces.pop()
        before, _, after = last.partition(s)
        pieces += [before, after]
    out: list[str] = []
    for piece in pieces:
        if piece and piece not in out and any(sp in piece for sp in specials):
            out.append(piece)
    return out


def chat_frames(tokenizer) -> tuple[str, ...]:
    """The texts a tokenizer's chat template puts around message contents (see the module
    docstring), e.g. for SmolLM2 ``("<|im_start|>system\\n", "<|im_end|>\\n<|im_start|>user\\n",
    "<|im_end|>\\n<|im_start|>assistant\\n", ...)``; ``()`` for a tokenizer without a usable
    template. Cached per tokenizer; never raises."""
    try:
        return _FRAMES[tokenizer]
    except (KeyError, TypeError):
        pass
    frames: list[str] = []
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        specials = _special_texts(tokenizer)
        for first in (0, 1):  # with a system message, then without (a template's default one)
            rendered = _render(tokenizer, first)
            if rendered is not None:
                frames += [f for f in frames_of(rendered, _SENTINELS[first:], specials) if f not in frames]
    out = tuple(frames)
    try:
        _FRAMES[tokenizer] = out
    except TypeError:
        pass
    return out
