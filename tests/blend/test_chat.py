"""Chat prompts segment at message boundaries (issue 35, :mod:`blend.chat`): with the real
SmolLM2 tokenizer and its ChatML template, the system message and every passage of a user
message, in first, middle or last position, have exactly the ids ``kvblend ingest`` stores
for them; the generation prompt belongs to the query; a multi-turn conversation's latest
passages too. Templates whose frames hold no special token give no frames."""

from __future__ import annotations

import pytest

from blend.chat import chat_frames, frames_of
from blend.config import DEFAULT_SEPARATOR
from blend.plan import CHUNK, QUERY, SEPARATOR
from blend.segments import (
    chunk_token_ids,
    find_segments,
    first_segment_as_chunk,
    special_tokens_around,
)

pytestmark = pytest.mark.unit

SEP = DEFAULT_SEPARATOR
SYSTEM = "You answer questions from the passages given."
PASSAGES = ["Ada Lovelace wrote the first published program for the Analytical Engine.",
            "The Analytical Engine was designed by Charles Babbage in 1837.",
            "Babbage's Difference Engine No. 2 was built by the Science Museum in 1991."]
QUESTION = "Question: who designed the machine Ada Lovelace programmed?"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _chat_ids(tokenizer, messages) -> list[int]:
    """The prompt vLLM builds for a chat request: the template's text, tokenized whole."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _segments(tokenizer, ids, frames):
    spans = find_segments(ids, tokenizer, SEP, frames)
    spans = first_segment_as_chunk(spans, ids, special_tokens_around(tokenizer))
    return spans, [ids[s:e] for kind, s, e in spans if kind == CHUNK]


def test_the_chatml_frames_are_found_and_hold_special_tokens(tokenizer):
    frames = chat_frames(tokenizer)
    for frame in ("<|im_start|>system\n", "<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"):
        assert frame in frames
    assert all("<|im_" in f for f in frames) and chat_frames(tokenizer) is frames  # cached


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_every_passage_and_the_system_message_are_segments_of_their_own(tokenizer, order):
    user = SEP.join([PASSAGES[i] for i in order] + [QUESTION])
    ids = _chat_ids(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    spans, chunks = _segments(tokenizer, ids, chat_frames(tokenizer))
    want = [chunk_token_ids(tokenizer, SYSTEM)] + [chunk_token_ids(tokenizer, PASSAGES[i]) for i in order]
    assert chunks == want
    kind, start, end = spans[-1]
    assert kind == QUERY and end == len(ids)
    query = tokenizer.decode(ids[start:end])
    assert query.startswith(QUESTION) and query.endswith("<|im_start|>assistant\n")
    assert spans[0][0] == SEPARATOR and spans[0][1] == 0  # the template's opening frame: computed

    # without the frames (the bug): the system message and the first passage are one segment
    _, glued = _segments(tokenizer, ids, ())
    assert chunk_token_ids(tokenizer, PASSAGES[order[0]]) not in glued


def test_a_multi_turn_conversation_keeps_its_latest_passages(tokenizer):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": SEP.join([PASSAGES[0], PASSAGES[1], "Who wrote it?"])},
                {"role": "assistant", "content": "Ada Lovelace."},
                {"role": "user", "content": SEP.join([PASSAGES[2], PASSAGES[0], QUESTION])}]
    ids = _chat_ids(tokenizer, messages)
    spans, chunks = _segments(tokenizer, ids, chat_frames(tokenizer))
    for p in PASSAGES:
        assert chunk_token_ids(tokenizer, p) in chunks
    assert chunks[-2:] == [chunk_token_ids(tokenizer, PASSAGES[2]), chunk_token_ids(tokenizer, PASSAGES[0])]
    assert tokenizer.decode(ids[spans[-1][1]:]).startswith(QUESTION)


def test_a_chat_without_the_separator_is_not_split(tokenizer):
    ids = _chat_ids(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert find_segments(ids, tokenizer, SEP, chat_frames(tokenizer)) == [("prefix", 0, len(ids))]


def test_a_user_message_ending_with_a_passage_makes_it_the_query(tokenizer):
    """Like a completion prompt, the last segment is the query (probed and computed, not
    looked up); a message ending with the separator leaves no query."""
    frames = chat_frames(tokenizer)
    ids = _chat_ids(tokenizer, [{"role": "user", "content": SEP.join(PASSAGES)}])
    spans, chunks = _segments(tokenizer, ids, frames)
    assert chunks[-2:] == [chunk_token_ids(tokenizer, p) for p in PASSAGES[:2]]
    assert spans[-1][0] == QUERY and tokenizer.decode(ids[spans[-1][1]:]).startswith(PASSAGES[2])


class _Template:
    """A tokenizer stand-in: ``apply_chat_template`` renders ``fmt`` per message."""

    chat_template = "stub"

    def __init__(self, fmt: dict[str, str], specials=(), system=True, generation=""):
        self.fmt, self.all_special_tokens, self.system, self.generation = fmt, list(specials), system, generation

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        if not self.system and messages[0]["role"] == "system":
            raise ValueError("System role not supported")
        return "".join(self.fmt[m["role"]].format(m["content"]) for m in messages) + self.generation


def test_plain_text_frames_are_not_used():
    tok = _Template({"system": "{}\n", "user": "User: {}\n", "assistant": "Assistant: {}\n"},
                    generation="Assistant:")
    assert chat_frames(tok) == ()


def test_a_template_without_a_system_role_is_rendered_without_it():
    tok = _Template({"user": "<s>[INST] {} [/INST]", "assistant": "{}</s>"}, specials=["<s>", "</s>"], system=False)
    # " [/INST]" holds no special token here: it stays with the text before it (the query's end)
    assert chat_frames(tok) == ("<s>[INST] ", "</s><s>[INST] ")


def test_a_template_that_always_raises_gives_no_frames():
    class Broken(_Template):
        def apply_chat_template(self, *a, **k):
            raise RuntimeError("template error")

    assert chat_frames(Broken({}, specials=["<s>"])) == ()


def test_frames_of_keeps_order_and_drops_repeats():
    assert frames_of("<a>S0<b>S1<c>x<b>S2<a>", ("S0", "S1", "S2"), {"<a>", "<b>"}) == ["<a>", "<b>", "<c>x<b>"]
    assert frames_of("plainS0<b>S1text", ("S0", "S1"), {"<b>"}) == ["<b>"]
