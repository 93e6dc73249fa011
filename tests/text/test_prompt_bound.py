"""A prompt bounded by the context before it is tokenized whole, and text that is not UTF-8 refused in one line.

`Tokenizer.encode(text, limit=n)` must give exactly the ids of `encode(text)` whenever they number at most `n`
(it tokenizes in chunks cut where the pre-tokenizer cuts anyway: checked here with chunks of a few characters,
on the tiny vocabulary and on the real Qwen2.5 one), refuse more than `n` tokens with `PromptTooLong`, and
refuse text longer than `n * max_token_bytes` characters without tokenizing it.
"""

from __future__ import annotations

import random
import re
import time
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fuselane.text.tokenizer as tokenizer_module
from fuselane.errors import FuselaneError
from fuselane.text.chat import CHATML_TEMPLATE, ChatTemplate, encode_chat
from fuselane.text.tokenizer import Tokenizer
from fuselane.text.utf8 import PromptTooLong, decode, require_utf8

from .test_tokenizer import CORPUS, load_metadata, synthetic_meta

SMALL_CHUNK = 5  # characters: every chunk boundary the bounded encoder can make shows up in short texts
# Pieces whose joins reach every pre-tokenizer rule and every added-token case.
PIECES = ["a", "b", "Z", "he", "llo", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "1", "23", ".", ",!?", "<", "|"]
PIECES += ["日", "é", "\u0301", "😀", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>", "<|im_", "end|>"]
BIG = 1 << 30  # a limit nothing here reaches
HUGE_PROMPT_CHARS = 20 << 20  # the 20 MB prompt of a careless pipe
REFUSE_SECONDS = 0.5


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_metadata(synthetic_meta())


def _bounded(tokenizer: Tokenizer, text: str, special: bool) -> list[int]:
    with mock.patch.object(tokenizer_module, "CHUNK_CHARS", SMALL_CHUNK):
        return tokenizer.encode(text, special=special, limit=BIG)


@given(parts=st.lists(st.sampled_from(PIECES), max_size=40))
@settings(max_examples=300, deadline=None)
def test_tiny_bounded_encode_is_the_whole_encode(tiny, parts):
    text = "".join(parts)
    for special in (False, True):
        assert _bounded(tiny, text, special) == tiny.encode(text, special=special)


@pytest.mark.real
def test_real_bounded_encode_is_the_whole_encode(qwen_gguf):
    qwen = Tokenizer.from_metadata(load_metadata(qwen_gguf))
    rng = random.Random(0)
    texts = [*CORPUS.values(), *("".join(rng.choices(PIECES, k=rng.randrange(60))) for _ in range(500))]
    for text in texts:
        for special in (False, True):
            assert _bounded(qwen, text, special) == qwen.encode(text, special=special), repr(text)


def test_max_token_bytes_bounds_every_token(tiny):
    assert max(len(tiny.decode([i])) for i in range(tiny.vocab_size)) <= tiny.max_token_bytes
    assert all(len(tiny._bytes(i, False)) <= tiny.max_token_bytes for i in range(tiny.vocab_size))


def test_limit_refuses_more_tokens(tiny):
    text = "hello world " * 10
    ids = tiny.encode(text)
    assert tiny.encode(text, limit=len(ids)) == ids
    with pytest.raises(PromptTooLong, match=f"more than {len(ids) - 1} tokens, past the context of {len(ids) - 1}"):
        tiny.encode(text, limit=len(ids) - 1)


def test_limit_refuses_a_huge_prompt_without_tokenizing_it(tiny):
    text = "a" * HUGE_PROMPT_CHARS
    started = time.perf_counter()
    with pytest.raises(PromptTooLong, match="past the context of 4096") as caught:
        tiny.encode(text, limit=4096)
    assert time.perf_counter() - started < REFUSE_SECONDS
    assert "\n" not in str(caught.value)


def test_limit_stops_early_within_the_character_bound(tiny):
    # short enough for the character bound, yet tokenizing stops at the first chunk past the limit
    limit = 1000
    text = "hello world " * (limit * tiny.max_token_bytes // 12)
    with mock.patch.object(tokenizer_module.Tokenizer, "_encode", wraps=tiny._encode) as backend:
        with pytest.raises(PromptTooLong):
            tiny.encode(text, limit=limit)
    assert sum(len(call.args[0]) for call in backend.call_args_list) < 2 * tokenizer_module.CHUNK_CHARS


def test_encode_chat_bounds_messages_and_rendering(tiny):
    chatml = ChatTemplate(CHATML_TEMPLATE)
    with pytest.raises(PromptTooLong, match="chat messages are .* past the context of 16"):
        encode_chat(tiny, chatml, [{"role": "user", "content": "x" * (16 * tiny.max_token_bytes + 1)}], limit=16)
    writes_much = ChatTemplate("{% for i in range(60) %}{{ 'x' * 1000000 }}{% endfor %}")
    started = time.perf_counter()
    with pytest.raises(PromptTooLong, match="chat prompt is more than .* past the context of 64"):
        encode_chat(tiny, writes_much, [{"role": "user", "content": "hi"}], limit=64)
    assert time.perf_counter() - started < REFUSE_SECONDS
    ids = encode_chat(tiny, chatml, [{"role": "user", "content": "hello"}], limit=64)
    assert ids == encode_chat(tiny, chatml, [{"role": "user", "content": "hello"}])
    with pytest.raises(PromptTooLong, match="past the context of 3"):
        encode_chat(tiny, chatml, [{"role": "user", "content": "hello"}], limit=3)


@pytest.mark.parametrize(
    "text, says",
    [
        ("abc\udcff", "the byte 0xFF at character 3"),
        ("\udcc3\udca9", "the byte 0xC3 at character 0"),
        ("x\ud800y", "a lone surrogate U+D800 at character 1"),
    ],
)
def test_text_that_is_not_utf8_is_one_error(tiny, text, says):
    with pytest.raises(FuselaneError, match=re.escape(f"not valid UTF-8: {says}") + "$"):
        require_utf8(text)
    for special in (False, True):
        with pytest.raises(FuselaneError, match="not valid UTF-8"):
            tiny.encode(text, special=special)
    with pytest.raises(FuselaneError, match="a chat message is not valid UTF-8"):
        encode_chat(tiny, ChatTemplate(CHATML_TEMPLATE), [{"role": "user", "content": text}])


def test_bytes_that_are_not_utf8_are_one_error():
    assert decode("héllo".encode()) == "héllo"
    with pytest.raises(FuselaneError, match="the prompt is not valid UTF-8: the byte 0xFF at byte 2"):
        decode(b"hi\xffthere", "the prompt")
