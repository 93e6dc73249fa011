"""The tokenizer a GGUF file describes, rebuilt on Hugging Face `tokenizers`.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, the BPE merges, a token type per token and the
name of the pre-tokenizer (`tokenizer.ggml.pre`) that llama.cpp recognised when it converted the model. From
those facts we build a `tokenizers.Tokenizer` directly -- a byte-level BPE whose pre-tokenizer splits text
with the regular expression the vocabulary was trained with -- instead of going through transformers, which
builds a slow Python tokenizer first and takes several seconds for a 150k vocabulary.

Control tokens (`<|im_end|>`) and user-defined tokens (`<tool_call>`) become added tokens, matched whole in
the text as llama.cpp matches them. Control tokens are only matched when the caller asks for it
(`encode(..., special=True)`, for text a chat template wrote); a user's text that spells `<|im_end|>` is
tokenized as the characters it is, so a prompt cannot forge the end of a turn.

`encode(text, limit=ctx)` bounds a prompt by the context before tokenizing it whole: no token stands for more
than `max_token_bytes` bytes, so a text of more characters than `limit * max_token_bytes` is refused without
tokenizing, and a shorter one is tokenized in chunks cut where the pre-tokenizer cuts anyway, stopping as soon
as it passes `limit` tokens. Text holding lone surrogates (undecodable bytes) is refused with one line.

Decoding maps each token back to its bytes ourselves (the byte-level alphabet of GPT-2), so `decode` and the
streaming decoder agree byte for byte, and the stream can hold back a character split across tokens.
"""

from __future__ import annotations

import codecs
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from fuselane.errors import FuselaneError, ModelError
from fuselane.text.utf8 import PromptTooLong, require_utf8

_KEY = "tokenizer.ggml."

# The pre-tokenizer regexes as the models' tokenizer.json files (and llama.cpp's llama-vocab.cpp) give them.
# Qwen2 splits digits one by one (`\p{N}`), where Llama 3 keeps runs of up to three.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@dataclass(frozen=True, slots=True)
class _PreTokenizer:
    """How one `tokenizer.ggml.pre` value splits text before BPE, and the llama.cpp defaults going with it."""

    split: str
    # Llama 3 looks a whole pre-token up in the vocabulary before merging (tokenizer.json's `ignore_merges`).
    ignore_merges: bool = False
    # What llama.cpp assumes when the file has no `tokenizer.ggml.add_bos_token`.
    add_bos: bool = False


_QWEN2 = _PreTokenizer(_QWEN2_SPLIT)
_LLAMA3 = _PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
# 'default' is what llama.cpp assumes when a file names no pre-tokenizer; like transformers, we use GPT-2's.
_GPT2 = _PreTokenizer(_GPT2_SPLIT)
_PRE_TOKENIZERS: Mapping[str, _PreTokenizer] = MappingProxyType(
    {
        "qwen2": _QWEN2,
        "deepseek-r1-qwen": _QWEN2,
        "llama-bpe": _LLAMA3,
        "llama3": _LLAMA3,
        "llama-v3": _LLAMA3,
        "gpt-2": _GPT2,
        "default": _GPT2,
    }
)
_SUPPORTED_MODEL = "gpt2"

# Token types matched whole in text. CONTROL and UNKNOWN only when the caller allows special tokens;
# USER_DEFINED always, as llama.cpp and transformers both do.
_SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.UNKNOWN})
_ADDED_TYPES = _SPECIAL_TYPES | {TokenType.USER_DEFINED}

# Control tokens that end a turn in the chat formats we know; generation stops on any the vocabulary has.
_END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
)

_UTF8 = "utf-8"
_BYTE_VALUES = 256
# Characters a bounded encode hands the backend at a time: big enough to amortize the call, small enough that
# the backend's per-character bookkeeping (about 150 bytes) stays a few MB.
CHUNK_CHARS = 1 << 16
# A cut the pre-tokenizers of `_PRE_TOKENIZERS` all make: after an ASCII letter, before an ASCII non-letter.
# No pre-token that holds a letter runs past the end of its letters, and what follows a cut is split the same
# whatever came before it, so encoding chunks cut there gives the ids of encoding the whole.
_CUT = re.compile(r"[A-Za-z](?=[\x00-\x40\x5b-\x60\x7b-\x7f])")
# Invalid bytes (a model can emit any byte token) come out as U+FFFD, never as an exception.
_ON_BAD_UTF8 = "replace"


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character table: printable bytes stand for themselves, the rest move up past U+0100.

    Byte-level BPE vocabularies spell every byte sequence with these 256 characters, so no token holds a
    space, a newline or a control character.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    unprintable = [byte for byte in range(_BYTE_VALUES) if byte not in table]
    # The first code point past the bytes' own; the unprintable bytes take the next ones, in order.
    table.update({byte: chr(_BYTE_VALUES + n) for n, byte in enumerate(unprintable)})
    return table


_CHAR_OF_BYTE = _byte_alphabet()
_BYTE_OF_CHAR = {char: byte for byte, char in _CHAR_OF_BYTE.items()}
_OUTSIDE_ALPHABET = re.compile("[^" + re.escape("".join(_BYTE_OF_CHAR)) + "]")


def _spell_bytes(text: str) -> str:
    """`text` in the byte-level alphabet (how a vocabulary stores a token written as plain UTF-8)."""
    return "".join(_CHAR_OF_BYTE[byte] for byte in text.encode(_UTF8))


def _required(meta: Mapping[str, Any], name: str) -> Any:
    value = meta.get(_KEY + name)
    if value is None:
        raise ModelError(f"GGUF tokenizer is incomplete: metadata key {_KEY + name!r} is missing")
    return value


def _optional_id(meta: Mapping[str, Any], name: str, vocab_size: int) -> int | None:
    value = meta.get(_KEY + name)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ModelError(f"GGUF tokenizer {_KEY + name} = {value!r} is not a token id (vocabulary of {vocab_size})")
    return int(value)


class Tokenizer:
    """Text to token ids and back, for the vocabulary of one GGUF file. Build it with `from_metadata`.

    `encode` never adds a BOS token; `add_bos` says whether the file asks for one in front of a prompt, so the
    caller (which knows whether a chat template already wrote it) decides.
    """

    __slots__ = (
        "_backend",
        "_lock",
        "_tokens",
        "_types",
        "_piece_bytes",
        "_special",
        "_special_pattern",
        "_added",
        "_added_patterns",
        "_max_token_bytes",
        "bos_id",
        "eos_id",
        "stop_ids",
        "add_bos",
    )

    def __init__(
        self,
        backend: _Backend,
        tokens: Sequence[str],
        types: Sequence[int],
        special: Mapping[str, int],
        *,
        user: Mapping[str, int] | None = None,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: frozenset[int],
        add_bos: bool,
    ) -> None:
        self._backend = backend
        # `encode_special_tokens` is a setting of the shared backend, so flipping it and encoding go together.
        self._lock = threading.Lock()
        self._tokens = tokens
        self._types = types
        # Filled on first use: turning all 150k tokens into bytes up front would double the build time.
        self._piece_bytes: list[bytes | None] = [None] * len(tokens)
        self._special = MappingProxyType(dict(special))
        # Longest first, so at any position the longest control token wins, as the backend's matcher does.
        alternatives = sorted(self._special, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        # user-defined tokens are matched whole in any text; control tokens too when special=True
        self._added = MappingProxyType({**(user or {}), **special})
        self._added_patterns: dict[bool, re.Pattern[str] | None] = {}
        self._max_token_bytes: int | None = None
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.add_bos = add_bos

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from a GGUF's `tokenizer.ggml.*` metadata.

        Raises `ModelError` for a tokenizer model or pre-tokenizer fuselane does not support, or a vocabulary
        that is incomplete or inconsistent.
        """
        model = meta.get(_KEY + "model")
        if model != _SUPPORTED_MODEL:
            raise ModelError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); fuselane reads only "
                f"{_SUPPORTED_MODEL!r} (byte-level BPE)"
            )
        pre_name = meta.get(_KEY + "pre") or "default"
        pre = _PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise ModelError(
                f"unsupported pre-tokenizer {pre_name!r} (tokenizer.ggml.pre); supported: "
                + ", ".join(sorted(_PRE_TOKENIZERS))
            )
        tokens = list(_required(meta, "tokens"))
        merges = _required(meta, "merges")
        size = len(tokens)
        raw_types = meta.get(_KEY + "token_type")
        types = list(map(int, raw_types)) if raw_types is not None else [TokenType.NORMAL] * size
        if len(types) != size:
            raise ModelError(f"GGUF tokenizer has {size} tokens but {len(types)} token types")

        bos_id = _optional_id(meta, "bos_token_id", size)
        eos_id = _optional_id(meta, "eos_token_id", size)
        ends = [_optional_id(meta, name, size) for name in ("eot_token_id", "eom_token_id")]
        if raw_types is None:
            # Without types nothing would be special; the ids the file names are control tokens by definition.
            for token_id in (bos_id, eos_id, _optional_id(meta, "padding_token_id", size), *ends):
                if token_id is not None:
                    types[token_id] = TokenType.CONTROL

        # Nearly every token is NORMAL; the few others are all that the rest of the build needs to look at.
        unusual = [(i, kind) for i, kind in enumerate(types) if kind != TokenType.NORMAL]
        special = {tokens[i]: i for i, kind in unusual if kind in _SPECIAL_TYPES and tokens[i]}
        user = {tokens[i]: i for i, kind in unusual if kind == TokenType.USER_DEFINED and tokens[i]}
        backend = _build_backend(tokens, special, user, merges, pre)
        added = {**user, **special}
        stop_ids = frozenset(
            [i for i in (eos_id, *ends) if i is not None] + [added[t] for t in _END_OF_TURN if t in added]
        )
        add_bos = meta.get(_KEY + "add_bos_token")
        return cls(
            backend,
            tokens,
            types,
            special,
            user=user,
            bos_id=bos_id,
            eos_id=eos_id,
            stop_ids=stop_ids,
            add_bos=pre.add_bos if add_bos is None else bool(add_bos),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, as the GGUF lists them (the model's embedding rows)."""
        return len(self._tokens)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """The control tokens, by spelling: matched in text only by `encode(..., special=True)`."""
        return self._special

    def token(self, token_id: int) -> str:
        """The vocabulary's spelling of one token (byte-level, so a leading space shows as 'Ġ')."""
        self._check_id(token_id)
        return self._tokens[token_id]

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any token's spelling takes, an upper bound of the bytes a token stands for: a
        text of more than `n * max_token_bytes` bytes (so also characters) is more than `n` tokens."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max((len(token.encode(_UTF8)) for token in self._tokens), default=1)
        return self._max_token_bytes

    def encode(self, text: str, *, special: bool = False, limit: int | None = None) -> list[int]:
        """Token ids for `text`; no BOS is added.

        special=True reads control tokens written out in the text (`<|im_start|>`) as those tokens: use it for
        text a chat template produced. special=False tokenizes such spellings as plain characters: use it for
        anything a user wrote. `limit` (a context's size) refuses, with `PromptTooLong`, a text of more than
        `limit` tokens without tokenizing all of it (see the module docstring). Text that is not valid UTF-8
        (lone surrogates) raises `FuselaneError`.
        """
        require_utf8(text)
        if limit is None:
            return self._encode(text, special)
        if len(text) > limit * self.max_token_bytes:
            raise PromptTooLong(
                f"the prompt is {len(text)} characters, more than {limit} tokens of at most "
                f"{self.max_token_bytes} bytes can hold: past the context of {limit}"
            )
        ids: list[int] = []
        for piece in self._pieces(text, special):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(self._encode(piece, special))
            if len(ids) > limit:
                raise PromptTooLong(f"the prompt is more than {limit} tokens, past the context of {limit}")
        return ids

    def _encode(self, text: str, special: bool) -> list[int]:
        with self._lock:
            self._backend.encode_special_tokens = not special
            return self._backend.encode(text, add_special_tokens=False).ids

    def _pieces(self, text: str, special: bool) -> Iterable[str | int]:
        """`text` as the backend splits it at added tokens (their ids), with the text between them cut into
        chunks of about `CHUNK_CHARS` where the pre-tokenizer cuts anyway (`_CUT`)."""
        if special not in self._added_patterns:
            control = set(self._special.values())
            spellings = sorted(
                (t for t, i in self._added.items() if special or i not in control), key=len, reverse=True
            )
            self._added_patterns[special] = re.compile("|".join(map(re.escape, spellings))) if spellings else None
        pattern = self._added_patterns[special]
        start = 0
        for match in pattern.finditer(text) if pattern is not None else ():
            yield from _chunks(text, start, match.start())
            yield self._added[match.group()]
            start = match.end()
        yield from _chunks(text, start, len(text))

    def split_special(self, text: str) -> list[str | int]:
        """`text` cut at the control tokens written in it: plain pieces, and the ids of the tokens between.

        This is the first step of `encode(text, special=True)`; encoding each piece with special=False and
        keeping the ids gives the same result.
        """
        if self._special_pattern is None:
            return [text] if text else []
        pieces: list[str | int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            if match.start() > start:
                pieces.append(text[start : match.start()])
            pieces.append(self._special[match.group()])
            start = match.end()
        if start < len(text):
            pieces.append(text[start:])
        return pieces

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of `ids`; skip_special=True leaves out control tokens. Bad UTF-8 comes out as U+FFFD."""
        data = b"".join(self._bytes(token_id, skip_special) for token_id in ids)
        return data.decode(_UTF8, _ON_BAD_UTF8)

    def stream(self, *, skip_special: bool = False) -> StreamDecoder:
        """A decoder for ids that arrive one at a time (generation): see `StreamDecoder`."""
        return StreamDecoder(self, skip_special)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise FuselaneError(f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})")

    def _bytes(self, token_id: int, skip_special: bool) -> bytes:
        """The bytes one token stands for (empty for a skipped control token)."""
        self._check_id(token_id)
        kind = self._types[token_id]
        if skip_special and kind in _SPECIAL_TYPES:
            return b""
        piece = self._piece_bytes[token_id]
        if piece is None:
            text = self._tokens[token_id]
            # Added tokens are stored as the text they match; normal tokens in the byte-level alphabet, except
            # the odd one a converter left in plain UTF-8 (which the backend's vocabulary respells too).
            plain = kind in _ADDED_TYPES or _OUTSIDE_ALPHABET.search(text) is not None
            piece = text.encode(_UTF8) if plain else bytes(_BYTE_OF_CHAR[char] for char in text)
            self._piece_bytes[token_id] = piece
        return piece


def _chunks(text: str, start: int, end: int) -> Iterable[str]:
    """text[start:end] in pieces of about `CHUNK_CHARS`, each cut at a `_CUT` (or not at all, if none)."""
    while end - start > CHUNK_CHARS:
        cut = _CUT.search(text, start + CHUNK_CHARS, end)
        if cut is None:
            break
        yield text[start : cut.end()]
        start = cut.end()
    if end > start:
        yield text[start:end]


@dataclass(slots=True)
class StreamDecoder:
    """Turns ids arriving one by one into text, never splitting a character.

    A character of several UTF-8 bytes (an emoji, most CJK) is often spread over two or more byte tokens;
    `push` returns only the text completed so far and holds the partial bytes back. Joining every `push` and a
    final `flush` gives exactly `tokenizer.decode(all_ids)`.
    """

    tokenizer: Tokenizer
    skip_special: bool = False
    _utf8: codecs.IncrementalDecoder = field(init=False)

    def __post_init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder(_UTF8)(_ON_BAD_UTF8)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        return self._utf8.decode(self.tokenizer._bytes(token_id, self.skip_special))

    def flush(self) -> str:
        """End of stream: return what was held back (U+FFFD for a character that never finished)."""
        return self._utf8.decode(b"", final=True)


def _build_backend(
    tokens: list[str],
    special: Mapping[str, int],
    user: Mapping[str, int],
    merges: Sequence[str],
    pre: _PreTokenizer,
) -> _Backend:
    """The `tokenizers` pipeline: added tokens, the pre-tokenizer split, byte-level mapping, BPE."""
    # Normal tokens must be in the byte-level alphabet for BPE to reach them; a converter occasionally stores
    # one as plain UTF-8. Checking the joined vocabulary once keeps the common case (none) fast.
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    if _OUTSIDE_ALPHABET.search("".join(tokens)) is not None:
        added = {*special.values(), *user.values()}
        vocab = {
            token if i in added or _OUTSIDE_ALPHABET.search(token) is None else _spell_bytes(token): i
            for i, token in enumerate(tokens)
        }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    try:
        bpe = models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=pre.ignore_merges)
    except Exception as exc:  # tokenizers reports bad merges as plain exceptions of several types
        raise ModelError(f"GGUF tokenizer merges do not fit its vocabulary: {exc}") from exc
    backend = _Backend(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
            # The split already made the pieces; this only maps their bytes to the alphabet.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # Added by spelling; each spelling is already in the vocabulary, so each keeps its GGUF id.
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in user])
    # An added token missing from the vocabulary would get a new id past the model's embedding rows.
    for token in (*special, *user):
        if backend.token_to_id(token) >= len(tokens):
            raise ModelError(f"GGUF tokenizer added token {token!r} has no id in the vocabulary")
    return backend
