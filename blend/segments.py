"""Segments of a blend prompt: find them on token ids, and build prompts whose chunks hit.

A blend prompt is ``system ⟨sep⟩ chunk ⟨sep⟩ chunk ... ⟨sep⟩ query`` (CacheBlend, Yao et al.,
EuroSys 2025, §5: chunks are precomputed independently and concatenated)::

    | prefix (BOS + system) | sep | chunk | sep | chunk | sep | query |

**Finding segments** (:func:`find_segments`) works on the *bytes* the token ids spell, not on
one fixed id sequence: BPE merges a separator with its neighbours in context (``" # # "``
alone, after BOS, and inside ``"you # #are"`` give different ids —
../shared/cases/separator-in-context.md). Each occurrence of the separator's bytes claims
every token that overlaps it; a token that straddles a separator and text goes to the
separator (always recomputed), so chunks hold only tokens of their own text.

**Canonical tokenization** (:func:`chunk_token_ids`): a chunk's ids are
``tokenizer.encode(text, add_special_tokens=False)``, what ingest stores. The default
separator ``"\\n# #\\n"`` starts and ends with a newline, which byte-level BPE never merges with
a following letter or a preceding word, so a passage keeps these ids inside a whole-string
prompt. LMCache's ``" # # "`` is found in every in-context form too, but its trailing space
merges into the next passage's first word (``" word"`` instead of ``"word"``), so passages of
a prompt tokenized as one string miss. Measured with SmolLM2's tokenizer on the first 20 rows
(10 passages each; all 200 segments found with both separators): ``"\n# #\n"`` keeps the
canonical ids of 200/200 passages on MuSiQue and 200/200 on 2WikiMQA; ``" # # "`` keeps 5/200
and 13/200 (a whole-string miss rate of 97.5% and 93.5%). Prompts built per piece by
:func:`build_blend_prompt` (or pre-tokenized per chunk), or tokenized segment-wise by vLLM's
``--tokenizer-mode kvblend`` (:mod:`cluster.vllm.segment_tokenizer`), hit with any separator.

**The first segment** (:func:`first_segment_as_chunk`): with nothing before it, a first segment's
KV at positions ``0..n-1`` is a standalone chunk's KV, so the serving path plans it as a chunk
(looked up, reused, stored) and keeps only the BOS its tokenizer adds
(:func:`special_tokens_around`) as the prefix: a passage in first position (a prompt with no
system prompt) is reused elsewhere, and a cached chunk can stand first.

Bookkeeping only: no torch.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Sequence

from blend.config import DEFAULT_SEPARATOR
from blend.plan import CHUNK, PREFIX, QUERY, SEPARATOR

Span = tuple[str, int, int]

_BYTE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SPECIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _byte_level_alphabet() -> dict[str, int]:
    """The reversible byte <-> printable-character map of byte-level BPE (GPT-2 scheme):
    printable Latin-1 bytes map to themselves, the other bytes to chr(256 + n) in order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = {}
    extra = 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_bytes_table(tokenizer) -> list[bytes]:
    """Bytes each token id spells, for byte-level BPE and SentencePiece-style vocabularies.

    Raises:
        ValueError: a tokenizer whose tokens cannot be mapped to bytes.
    """
    try:
        return _BYTE_TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab_size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    added = {t.content if hasattr(t, "content") else str(t)
             for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", ""))
    table: list[bytes] = []
    if "ByteLevel" in decoder:
        alphabet = _byte_level_alphabet()
        for tok in tokens:
            if tok is None:
                table.append(b"")
            elif tok in added or any(c not in alphabet for c in tok):
                table.append(tok.encode())
            else:
                table.append(bytes(alphabet[c] for c in tok))
    elif "Metaspace" in decoder or "Replace" in decoder or "▁" in "".join(t or "" for t in tokens[:2000]):
        for tok in tokens:
            if tok is None:
                table.append(b"")
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                table.append(bytes([int(tok[3:5], 16)]))
            else:
                table.append(tok.replace("▁", " ").encode())
    else:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} (decoder {decoder[:60]}) is neither "
                         f"byte-level BPE nor SentencePiece: cannot locate separators in token ids")
    try:
        _BYTE_TABLES[tokenizer] = table
    except TypeError:
        pass
    return table


def split_text(text: str, separator: str) -> list[str]:
    """Pieces of ``text`` between separators (``len == text.count(separator) + 1``).

    Raises:
        ValueError: empty separator.
    """
    if not separator:
        raise ValueError("separator='' is not allowed")
    return text.split(separator)


def find_segments(token_ids: Sequence[int], tokenizer, separator: str,
                  frames: Sequence[str] = ()) -> list[Span]:
    """Segment spans of a prompt given as token ids, whatever ids the separator took.

    Args:
        token_ids: the whole prompt.
        tokenizer: a HF tokenizer (byte-level BPE or SentencePiece vocabulary).
        separator: the separator string.
        frames: texts that bound segments like the separator does, in a prompt that holds the
            separator (the chat template's text around messages, :func:`blend.chat.chat_frames`).

    Returns:
        ``(kind, start, end)`` spans tiling ``[0, len(token_ids))`` in order, kinds ``prefix``
        (before the first separator or frame), ``sep`` (a separator or frame; adjacent ones
        merge into one), ``chunk`` (between them), ``query`` (after the last one; when the
        prompt ends with a frame, e.g. a chat template's generation prompt, the segment before
        it and that frame). Empty spans are left out. No separator: one ``prefix`` span over
        the whole prompt, frames or not.

    Raises:
        ValueError: empty separator, unsupported tokenizer, or an id outside the vocabulary.
    """
    if not separator:
        raise ValueError("separator='' is not allowed")
    n = len(token_ids)
    if n == 0:
        return []
    table = _token_bytes_table(tokenizer)
    starts: list[int] = []
    ends: list[int] = []
    pos = 0
    pieces = []
    for t in token_ids:
        if not 0 <= int(t) < len(table):
            raise ValueError(f"token id {t} outside the tokenizer's vocabulary ({len(table)})")
        b = table[int(t)]
        starts.append(pos)
        pos += len(b)
        ends.append(pos)
        pieces.append(b)
    text = b"".join(pieces)
    found = _token_spans(text, separator.encode(), starts, ends, is_frame=False)
    if not found:
        return [(PREFIX, 0, n)]
    for frame in frames:
        if frame:
            found += _token_spans(text, frame.encode(), starts, ends, is_frame=True)
    found.sort()
    bounds: list[list] = []  # [first, last, only frames]
    for first, last, is_frame in found:
        if bounds and first <= bounds[-1][1]:
            bounds[-1][1] = max(bounds[-1][1], last)
            bounds[-1][2] = bounds[-1][2] and is_frame
        else:
            bounds.append([first, last, is_frame])
    query_from = None  # a prompt ending with a frame: the segment before it is the query's
    if len(bounds) > 1 and bounds[-1][1] >= n and bounds[-1][2] and bounds[-2][1] < bounds[-1][0]:
        query_from = bounds.pop()[0]
    spans: list[Span] = []
    cursor = 0
    for i, (s, e, _) in enumerate(bounds):
        if s > cursor:
            spans.append((PREFIX if i == 0 else CHUNK, cursor, s))
        spans.append((SEPARATOR, s, e))
        cursor = e
    if query_from is not None or cursor < n:
        spans.append((QUERY, cursor, n))
    return spans


def _token_spans(text: bytes, pattern: bytes, starts: list[int], ends: list[int],
                 is_frame: bool) -> list[tuple[int, int, bool]]:
    """``(first, last, is_frame)`` token ranges covering each occurrence of ``pattern`` in the
    prompt's ``text``: every token that overlaps an occurrence (``starts``/``ends``: each
    token's byte range), so a token straddling it and text goes with it."""
    out = []
    at = text.find(pattern)
    while at >= 0:
        first = bisect.bisect_right(ends, at)                  # first token ending after the start
        last = bisect.bisect_left(starts, at + len(pattern))   # one past the last token starting before the end
        out.append((first, last, is_frame))
        at = text.find(pattern, at + len(pattern))
    return out


def special_tokens_around(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(before, after)``: the ids a tokenizer adds around a text when asked for special tokens
    (``(BOS,), ()`` for Llama-style tokenizers, ``(), ()`` for SmolLM2 or Qwen). Found by encoding
    one letter with and without them; ``((), ())`` when the two do not line up."""
    try:
        return _SPECIALS[tokenizer]
    except (KeyError, TypeError):
        pass
    with_special = list(tokenizer.encode("a", add_special_tokens=True))
    bare = list(tokenizer.encode("a", add_special_tokens=False))
    out: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    for i in range(len(with_special) - len(bare) + 1):
        if bare and with_special[i:i + len(bare)] == bare:
            out = (tuple(with_special[:i]), tuple(with_special[i + len(bare):]))
            break
    try:
        _SPECIALS[tokenizer] = out
    except TypeError:
        pass
    return out


def standalone_span(token_ids: Sequence[int], start: int, end: int,
                    specials: tuple[Sequence[int], Sequence[int]]) -> tuple[int, int]:
    """``[start, end)`` without the special ids the tokenizer put at the prompt's ends (``specials``
    from :func:`special_tokens_around`): what is left is the text's own ids, the chunk a passage
    sent alone stands for (``chunk_token_ids`` of its text)."""
    before, after = tuple(specials[0]), tuple(specials[1])
    if before and start == 0 and tuple(token_ids[:len(before)]) == before:
        start = len(before)
    n = len(token_ids)
    if after and end == n and n - len(after) >= start and tuple(token_ids[n - len(after):]) == after:
        end = n - len(after)
    return start, max(start, end)


def standalone_chunk_spans(spans, token_ids, specials) -> list[tuple[int, int]]:
    """Spans of a prompt stored as chunks although the plan never reuses them there:

    * a prompt with no separator is a passage sent to precompute it (LMCache's recipe sends
      ``chunk`` alone): its text's ids, without the BOS/EOS the tokenizer added;
    * the last segment of ``system ⟨sep⟩ passage`` (no chunk between separators; LMCache's
      recipe precomputes its first chunk this way) is that passage.

    The first segment of a separator prompt is a chunk of the plan already
    (:func:`first_segment_as_chunk`). ``specials`` is :func:`special_tokens_around` of the
    tokenizer. Called by the vLLM scheduler half for every prompt it plans.
    """
    n = len(token_ids)
    kinds = [kind for kind, _, _ in spans]
    if SEPARATOR not in kinds:
        start, end = standalone_span(token_ids, 0, n, specials)
        return [(start, end)] if end > start else []
    if CHUNK in kinds or kinds[-1] != QUERY:
        return []
    _, start, _ = spans[-1]
    start, end = standalone_span(token_ids, start, n, ((), specials[1]))
    return [(start, end)] if end > start else []


def first_segment_as_chunk(spans: Sequence[Span], token_ids: Sequence[int],
                           specials: tuple[Sequence[int], Sequence[int]] = ((), ())) -> list[Span]:
    """The prompt's first segment as a ``chunk`` span, so it is looked up and stored like any
    passage (a prompt with no system prompt, ``passage ⟨sep⟩ passage ⟨sep⟩ question``, starts
    with one)::

        | BOS | passage or system prompt | sep | chunk | sep | query |
        prefix [                chunk   ]

    Its KV at positions ``0..n-1`` with nothing before it *is* a standalone chunk's KV, so a
    cached chunk can stand in first position and a first segment is a chunk elsewhere. Only the
    ids the tokenizer adds before any text (BOS; ``specials`` from :func:`special_tokens_around`)
    stay a ``prefix``. Spans without a separator, or whose first span is not a ``prefix``, are
    returned unchanged.
    """
    spans = list(spans)
    if not spans or spans[0][0] != PREFIX or not any(kind == SEPARATOR for kind, _, _ in spans):
        return spans
    _, _, end = spans[0]
    start, _ = standalone_span(token_ids, 0, end, (specials[0], ()))
    if start >= end:
        return spans
    return ([(PREFIX, 0, start)] if start else []) + [(CHUNK, start, end)] + spans[1:]


def chunk_token_ids(tokenizer, chunk_text: str) -> list[int]:
    """Canonical token ids of a passage: tokenized alone, no BOS/EOS (what ingest stores)."""
    return list(tokenizer.encode(chunk_text, add_special_tokens=False))


def build_blend_prompt(tokenizer, system: str, chunks: Sequence[str], query: str,
                       separator: str = DEFAULT_SEPARATOR,
                       add_bos: bool = True) -> tuple[list[int], list[Span]]:
    """Token ids of ``[BOS] system ⟨sep⟩ c1 ⟨sep⟩ ... ⟨sep⟩ query``, tokenized per piece.

    Chunk ids equal :func:`chunk_token_ids` (so every cached chunk hits); the separator is
    tokenized alone. Empty pieces produce no span; separators that end up adjacent merge.

    Returns:
        ``(token_ids, spans)`` with spans as in :func:`find_segments`.

    Raises:
        ValueError: empty separator.
    """
    if not separator:
        raise ValueError("separator='' is not allowed")
    sep_ids = list(tokenizer.encode(separator, add_special_tokens=False))
    prefix_ids = list(tokenizer.encode(system, add_special_tokens=False)) if system else []
    if add_bos and tokenizer.bos_token_id is not None:
        prefix_ids = [tokenizer.bos_token_id] + prefix_ids
    pieces: list[tuple[str, list[int]]] = [(PREFIX, prefix_ids)]
    for chunk in chunks:
        pieces += [(SEPARATOR, sep_ids), (CHUNK, chunk_token_ids(tokenizer, chunk))]
    pieces += [(SEPARATOR, sep_ids), (QUERY, list(tokenizer.encode(query, add_special_tokens=False)))]
    token_ids: list[int] = []
    spans: list[Span] = []
    for kind, ids in pieces:
        if not ids:
            continue
        start = len(token_ids)
        token_ids += ids
        if kind == SEPARATOR and spans and spans[-1][0] == SEPARATOR:
            spans[-1] = (SEPARATOR, spans[-1][1], len(token_ids))
        else:
            spans.append((kind, start, len(token_ids)))
    return token_ids, spans
