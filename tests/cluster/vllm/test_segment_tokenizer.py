"""Issue 21 (b): ``--tokenizer-mode kvblend`` tokenizes a one-string blend prompt segment by
segment, so every passage has the ids it has alone (and its chunk key). vLLM's cached SmolLM2
tokenizer, no engine: the wrapper, the copies vLLM makes of it, the chat-template path, the
separator the renderer reads, and the registration."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest

from blend.segments import chunk_token_ids, find_segments
from cluster.vllm.segment_tokenizer import (
    TOKENIZER_MODE,
    encode_segment_wise,
    register,
    segment_aware,
    separator_for,
)

pytestmark = pytest.mark.unit

SEP = " # # "
SYSTEM = "You are a very helpful assistant."
CHUNKS = ["Hello, how are you?" * 4, "Hello, what's up?" * 4, "Hey, how can i do" * 4]
QUERY = "Hello, how are you?"
TEXT = SYSTEM + SEP + SEP.join(CHUNKS) + SEP + QUERY


@pytest.fixture(scope="module")
def vllm_tokenizer(smollm2_path):
    from vllm.tokenizers.hf import CachedHfTokenizer

    return CachedHfTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def wrapped(vllm_tokenizer):
    return segment_aware(vllm_tokenizer, SEP)


def chunk_ids_found(ids, tokenizer) -> list[list[int]]:
    return [list(ids[s:e]) for kind, s, e in find_segments(ids, tokenizer, SEP) if kind == "chunk"]


def test_whole_string_tokenization_changes_the_passages_ids(vllm_tokenizer):
    """The problem: BPE merges the separator's trailing space into the next passage."""
    ids = vllm_tokenizer(TEXT)["input_ids"]
    assert chunk_ids_found(ids, vllm_tokenizer) != [chunk_token_ids(vllm_tokenizer, c) for c in CHUNKS]


def test_segment_wise_ids_are_each_passage_alone(wrapped, vllm_tokenizer):
    ids = wrapped(TEXT)["input_ids"]
    assert chunk_ids_found(ids, vllm_tokenizer) == [chunk_token_ids(vllm_tokenizer, c) for c in CHUNKS]
    assert wrapped.encode(TEXT) == ids
    assert vllm_tokenizer.decode(ids) == TEXT
    sep_ids = vllm_tokenizer.encode(SEP, add_special_tokens=False)
    assert ids == (vllm_tokenizer.encode(SYSTEM, add_special_tokens=False) + sep_ids
                   + sum((chunk_token_ids(vllm_tokenizer, c) + sep_ids for c in CHUNKS), [])
                   + vllm_tokenizer.encode(QUERY, add_special_tokens=False))


def test_text_without_separator_is_tokenized_as_in_hf_mode(wrapped, vllm_tokenizer):
    for text in (CHUNKS[0], "", SYSTEM + " #" + CHUNKS[1]):
        assert wrapped(text)["input_ids"] == vllm_tokenizer(text)["input_ids"]
        assert wrapped.encode(text) == vllm_tokenizer.encode(text)


def test_offsets_point_at_each_tokens_text(wrapped, vllm_tokenizer):
    enc = wrapped(TEXT, return_offsets_mapping=True, add_special_tokens=True, truncation=False)
    assert len(enc["offset_mapping"]) == len(enc["input_ids"])
    spelled = "".join(TEXT[s:e] for s, e in enc["offset_mapping"])
    assert spelled == TEXT


def test_special_tokens_go_around_the_whole_prompt():
    """A BOS-adding tokenizer: one BOS before the prompt, none before the pieces."""
    def encode(piece, want_offsets):
        return [ord(c) for c in piece], ([(i, i + 1) for i in range(len(piece))] if want_offsets else None)

    ids, offsets = encode_segment_wise(encode, "ab|c||d", "|", ((1,), (2,)), want_offsets=True)
    assert ids == [1, 97, 98, 124, 99, 124, 124, 100, 2]
    assert offsets == [(0, 0), (0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (0, 0)]
    assert encode_segment_wise(encode, "ab|c", "|", ((1,), (2,)), add_special_tokens=False)[0] == [97, 98, 124, 99]
    assert encode_segment_wise(encode, "abc", "|", ((1,), ())) is None
    with pytest.raises(ValueError, match="separator"):
        encode_segment_wise(encode, "abc", "", ((), ()))


def test_truncation_past_max_length_and_unusual_calls_are_hf_mode(wrapped, vllm_tokenizer):
    full = wrapped(TEXT)["input_ids"]
    assert wrapped(TEXT, truncation=True, max_length=len(full) + 1)["input_ids"] == full
    assert wrapped(TEXT, truncation=True, max_length=10)["input_ids"] == \
        vllm_tokenizer(TEXT, truncation=True, max_length=10)["input_ids"]
    assert wrapped([TEXT, TEXT])["input_ids"] == vllm_tokenizer([TEXT, TEXT])["input_ids"]


def test_chat_template_path_is_segment_wise(wrapped, vllm_tokenizer):
    messages = [{"role": "user", "content": TEXT}]
    ids = wrapped.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert chunk_ids_found(ids, vllm_tokenizer) == [chunk_token_ids(vllm_tokenizer, c) for c in CHUNKS]


def test_chat_passages_in_first_position_and_the_system_message_are_chunks(wrapped, vllm_tokenizer):
    """Issue 35, with ``--tokenizer-mode kvblend`` and LMCache's separator: a system message and
    a user message ``chunk # # chunk # # chunk # # question`` (no leading separator) give the
    system message and every passage, the first included, their canonical ids once segments
    are bounded by the chat template's frames too (:func:`blend.chat.chat_frames`)."""
    from blend.chat import chat_frames
    from blend.segments import first_segment_as_chunk, special_tokens_around

    for order in ((0, 1, 2), (2, 0, 1)):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": SEP.join([CHUNKS[i] for i in order] + [QUERY])}]
        ids = list(wrapped.apply_chat_template(messages, tokenize=True, return_dict=False,
                                               add_generation_prompt=True))
        spans = first_segment_as_chunk(find_segments(ids, vllm_tokenizer, SEP, chat_frames(vllm_tokenizer)),
                                       ids, special_tokens_around(vllm_tokenizer))
        got = [list(ids[s:e]) for kind, s, e in spans if kind == "chunk"]
        assert got == [chunk_token_ids(vllm_tokenizer, t) for t in [SYSTEM] + [CHUNKS[i] for i in order]]


def test_copies_pickles_and_vllms_pool_keep_the_wrapper(wrapped):
    from vllm.tokenizers import maybe_make_thread_pool

    want = wrapped(TEXT)["input_ids"]
    for other in (copy.copy(wrapped), copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        assert other(TEXT)["input_ids"] == want
    pooled = copy.copy(wrapped)
    maybe_make_thread_pool(pooled, 2)
    assert pooled(TEXT)["input_ids"] == want and pooled.encode(TEXT) == want
    assert pickle.loads(pickle.dumps(pooled))(TEXT)["input_ids"] == want


def test_separator_is_the_connectors_effective_one(monkeypatch, tmp_path):
    for var in ("KVBLEND_CONFIG", "LMCACHE_CONFIG_FILE", "KVBLEND_BLEND_SEPARATOR", "LMCACHE_BLEND_SPECIAL_STR"):
        monkeypatch.delenv(var, raising=False)
    assert separator_for(SimpleNamespace(kv_transfer_config=None)) == "\n# #\n"
    yaml = tmp_path / "lmcache.yaml"
    yaml.write_text('enable_blending: true\nblend_special_str: " # # "\n')
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(yaml))
    assert separator_for(SimpleNamespace(kv_transfer_config=None)) == SEP
    extra = SimpleNamespace(kv_connector_extra_config={"blend_separator": "\n##\n", "stats_path": "x"})
    assert separator_for(SimpleNamespace(kv_transfer_config=extra)) == "\n##\n"


def test_register_adds_the_tokenizer_mode_to_vllm():
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers import TokenizerRegistry

    register()
    register()   # idempotent
    assert TokenizerRegistry.load_tokenizer_cls(TOKENIZER_MODE).__name__ == "CachedHfTokenizer"
    assert RENDERER_REGISTRY.load_renderer_cls(TOKENIZER_MODE).__name__ == "SegmentRenderer"
