"""Text coming in (argv, stdin, the Python API) checked as UTF-8, and read no further than a context can use.

Python hands argv (and stdin under a POSIX locale) over with undecodable bytes smuggled in as lone
surrogates ('\\udcff' for the byte 0xFF); the tokenizer's Rust side cannot take those and would fail with a
traceback. fuselane refuses such text with one error naming the first bad byte and where it is, rather than
replacing it: a prompt silently altered is worse than a prompt refused.

Reading stdin is bounded too: a prompt longer than `ctx * max_token_bytes` bytes cannot fit the context
whatever it tokenizes to, so `read_text` stops one byte past that bound instead of reading an endless pipe.
"""

from __future__ import annotations

import re
from typing import BinaryIO, TextIO

from fuselane.errors import FuselaneError

_UTF8 = "utf-8"
_SURROGATE = re.compile("[\ud800-\udfff]")
# Python's surrogateescape maps an undecodable byte b to the code point 0xDC00 + b (b >= 0x80).
_ESCAPED_FIRST, _ESCAPED_LAST, _ESCAPE_BASE = 0xDC80, 0xDCFF, 0xDC00


class PromptTooLong(FuselaneError):
    """A prompt longer than the context can hold, known before (or while) it is tokenized."""


def require_utf8(text: str, what: str = "the text") -> str:
    """`text`, if it holds no lone surrogate (an undecodable byte, or a half of a UTF-16 pair); otherwise a
    one-line `FuselaneError` naming the first one."""
    found = _SURROGATE.search(text)
    if found is None:
        return text
    code = ord(found.group())
    if _ESCAPED_FIRST <= code <= _ESCAPED_LAST:
        detail = f"the byte 0x{code - _ESCAPE_BASE:02X}"
    else:
        detail = f"a lone surrogate U+{code:04X}"
    raise FuselaneError(f"{what} is not valid UTF-8: {detail} at character {found.start()}")


def decode(data: bytes, what: str = "the text") -> str:
    """`data` decoded as UTF-8, or a one-line `FuselaneError` naming the first invalid byte and its offset."""
    try:
        return data.decode(_UTF8)
    except UnicodeDecodeError as exc:
        raise FuselaneError(
            f"{what} is not valid UTF-8: the byte 0x{data[exc.start]:02X} at byte {exc.start}"
        ) from None


def read_text(
    stream: BinaryIO | TextIO, limit: int, what: str = "the prompt", *, line: bool = False, context: int | None = None
) -> str | None:
    """Read all of `stream` (or one line of it, `line=True`; None at the end of input) as UTF-8, refusing
    (`PromptTooLong`) more than `limit` bytes without reading past them; `context`, the context's size in
    tokens the limit comes from, is named in that error. A text stream (one without bytes underneath, as
    tests and embedders may give) is read the same way, counting characters."""
    data = stream.readline(limit + 1) if line else stream.read(limit + 1)
    if line and not data:
        return None
    newline = "\n" if isinstance(data, str) else b"\n"
    body = data[:-1] if line and data.endswith(newline) else data
    if len(body) > limit:
        past = f"past the context of {context}" if context is not None else "more than the context can hold"
        raise PromptTooLong(f"{what} is more than {limit} bytes: {past}")
    return require_utf8(data, what) if isinstance(data, str) else decode(data, what)
