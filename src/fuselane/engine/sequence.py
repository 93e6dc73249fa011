"""A request, the sequence that runs it, and the events it reports to whoever submitted it.

A sequence's `tokens` are its prompt and what it has generated so far; `cached` counts the leading ones whose
rows its cache blocks hold. The last token is always the one fed next: while `cached` < len(tokens) - 1 the
sequence is prefilling (its prompt but the last token, in chunks), then each decode row feeds the last token
and samples the one after it, as `Model.generate_ids` runs a single sequence.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from fuselane.engine.blocks import BlockTable
from fuselane.engine.stops import StopText
from fuselane.runtime.sampling import GREEDY, Sampler, SamplingParams


class Finish(enum.Enum):
    """Why a sequence ended (the first two are OpenAI's `finish_reason`s)."""

    STOP = "stop"  # a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the end of the context
    CANCELLED = "cancelled"  # its client went away
    ERROR = "error"  # the lane failed while running it


@dataclass(frozen=True, slots=True)
class Request:
    """What to generate: prompt tokens, at most `max_tokens` more (None: up to the context's end), how to sample
    them, and strings that end the reply where they appear. `ignore_eos` (as vLLM's): the model's end tokens do
    not end the reply, so it runs to `max_tokens` (benchmarks that time a fixed number of tokens)."""

    prompt: tuple[int, ...]
    max_tokens: int | None = None
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class Event:
    """What a step did for one sequence: new text and tokens, and the finish once it ends."""

    seq: int
    text: str
    tokens: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    finish: Finish | None = None
    error: str | None = None


Sink = Callable[[Event], None]


@dataclass(slots=True, eq=False)
class Sequence:
    """One request in flight."""

    id: int
    request: Request
    text: StopText
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    generated: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    finish: Finish | None = None

    @classmethod
    def start(cls, seq_id: int, request: Request, text: StopText) -> Sequence:
        return cls(seq_id, request, text, Sampler(request.sampling), list(request.prompt))

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.tokens) - 1

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    def event(self, text: str, tokens: tuple[int, ...] = (), error: str | None = None) -> Event:
        return Event(self.id, text, tokens, self.prompt_tokens, self.generated, self.finish, error)
