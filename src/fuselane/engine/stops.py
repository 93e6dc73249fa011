"""The text a sequence shows as it is generated, cut at the first stop string.

Text that could still become a stop string is held back until the next token decides it, so a streamed reply
never shows the first half of a stop string and then ends; a stop string is never shown. Tokens arrive through
the tokenizer's stream decoder, which already holds back a character split across tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from fuselane.text.tokenizer import StreamDecoder


class StopText:
    """Pushes tokens in, gives out the text safe to show; `stopped` once a stop string has appeared."""

    def __init__(self, decoder: StreamDecoder, stops: Sequence[str] = ()) -> None:
        self.decoder, self.stops = decoder, tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """The text that `token` makes safe to show (nothing once stopped)."""
        if self.stopped:
            return ""
        return self._scan(self.held + self.decoder.push(token), final=False)

    def flush(self) -> str:
        """The end of the sequence: what was held back, up to a stop string if one completes in it."""
        if self.stopped:
            return ""
        return self._scan(self.held + self.decoder.flush(), final=True)

    def _scan(self, text: str, *, final: bool) -> str:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = 0 if final else self._partial(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _partial(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string (and so may still complete it)."""
        longest = max((len(s) - 1 for s in self.stops), default=0)
        for k in range(min(longest, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                return k
        return 0
