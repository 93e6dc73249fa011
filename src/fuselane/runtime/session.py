"""A sequence in progress: the tokens its KV cache holds, prefill in chunks, and decode one token at a time.

A session reuses what its cache already holds: fed a conversation that extends the tokens it has, it runs only
the new ones (multi-turn chat keeps its cache between turns); fed one that diverges, it rewinds to the common
prefix first. A prompt that would pass the context is refused before anything runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from fuselane.errors import FuselaneError

DEFAULT_CHUNK = 256  # prefill rows per graph run: big enough for BLAS, small enough for bounded attention scores


class Lane(Protocol):
    ctx: int

    def forward(self, ids: np.ndarray, pos: int, *, all_logits: bool = False) -> np.ndarray: ...


class Session:
    """One sequence over a lane's cache."""

    def __init__(self, lane: Lane, *, chunk: int = DEFAULT_CHUNK) -> None:
        self.lane, self.chunk = lane, chunk
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
        if not ids:
            raise FuselaneError("nothing to feed: the prompt is empty")
        if len(ids) > self.ctx:
            raise FuselaneError(f"the prompt is {len(ids)} tokens, longer than the context of {self.ctx}")
        common = 0
        for a, b in zip(self.tokens, ids, strict=False):
            if a != b:
                break
            common += 1
        # the last token always runs again so there are logits to return
        common = min(common, len(ids) - 1)
        self.tokens = self.tokens[:common]
        return self.extend(ids[common:])

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
