"""A sequence in progress: the tokens its KV cache holds, prefill in chunks, and decode one token at a time.

A session reuses what its cache already holds: fed a conversation that extends the tokens it has, it runs only
the new ones (multi-turn chat keeps its cache between turns); fed one that diverges, it rewinds to the common
prefix first. A prompt that would pass the context is refused before anything runs.

`tokens` are the tokens the cache holds for the session. The lane's decode loop may have computed one row
past them (it runs a step ahead of the tokens read); such a row is overwritten by the next feed at its
position before anything reads it, so `tokens` stays the truth.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from fuselane.errors import FuselaneError
from fuselane.runtime.sampling import SamplingParams

DEFAULT_CHUNK = 256  # prefill rows per graph run: big enough for BLAS, small enough for bounded attention scores


class Lane(Protocol):
    ctx: int

    def forward(self, ids: np.ndarray, pos: int, *, all_logits: bool = False) -> np.ndarray: ...

    def decode(self, token: int, pos: int, sampling: SamplingParams) -> Iterator[int]: ...


class Session:
    """One sequence over a lane's cache."""

    def __init__(self, lane: Lane, *, chunk: int | None = None) -> None:
        # a lane may run prompts in chunks of its own (`prefill_chunk`: the cuda lane's mixtures take 512 rows)
        self.lane = lane
        self.chunk = chunk or getattr(lane, "prefill_chunk", None) or DEFAULT_CHUNK
        self.tokens: list[int] = []

    @property
    def ctx(self) -> int:
        return self.lane.ctx

    def room(self) -> int:
        """Tokens that still fit in the context."""
        return self.ctx - len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def feed(self, ids: Sequence[int]) -> np.ndarray:
        """Make the cache hold `ids` (reusing its common prefix) and return the logits after the last one."""
        ids = list(ids)
        return self.extend(ids[self._rewind(ids) :])

    def prepare(self, ids: Sequence[int]) -> int:
        """Make the cache hold all of `ids` but the last (reusing its common prefix), and return the position
        of the last: the lane's decode loop feeds that one and samples what follows."""
        ids = list(ids)
        common = self._rewind(ids)
        if common < len(ids) - 1:
            self.extend(ids[common:-1])
        return len(self.tokens)

    def _rewind(self, ids: list[int]) -> int:
        """Check `ids` fit, cut the session back to its common prefix with them and return its length; the
        last of `ids` always runs again, so there are logits after it."""
        if not ids:
            raise FuselaneError("nothing to feed: the prompt is empty")
        if len(ids) > self.ctx:
            raise FuselaneError(f"the prompt is {len(ids)} tokens, longer than the context of {self.ctx}")
        common = 0
        for a, b in zip(self.tokens, ids, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        if common < len(self.tokens) and getattr(self.lane, "recurrent", False):
            common = 0  # a recurrent state sums every token it has seen: it starts again, never rewinds
        self.tokens = self.tokens[:common]
        return common

    def extend(self, ids: Sequence[int]) -> np.ndarray:
        """Run `ids` after what the cache holds, in chunks; logits after the last one."""
        if len(ids) > self.room():
            raise FuselaneError(f"{len(self.tokens) + len(ids)} tokens would pass the context of {self.ctx}")
        logits = None
        for start in range(0, len(ids), self.chunk):
            piece = ids[start : start + self.chunk]
            logits = self.lane.forward(np.asarray(piece), len(self.tokens))
            self.tokens.extend(piece)
        assert logits is not None
        return logits[-1]
