"""What a lane implements to run many sequences at once: "step these sequences".

A step is a list of `Work`: for each sequence, the tokens it feeds (a prefill chunk, or the one token of a decode
row), the position of the first, its block table, and its sampler where the step samples its next token. The
lane runs them (together, or one after another), keeps each sequence's KV rows in the pool blocks its table
names, and returns each sequence's sampled token (None for a chunk that samples nothing). A lane joins by adding
a row to the table in `fuselane.engine.lanes`: its class, built from the lane, the pool's size in blocks and the
block size.

What a lane may rely on: a step lists the decode rows first (one token each, every one sampling: a batch form runs
them as one launch sequence, each row at its own position over its own blocks), then prefill chunks of at most the
scheduler's `chunk` rows in all; a table already holds the blocks of every row its work writes; a sequence appears
once a step; block ids are below the pool's size; after `forget(seq)` the sequence never appears again. The sampler
carries the sequence's settings (`sampler.params`) and its host generator; a lane that samples on the device keeps
its own generator per sequence, seeded from `params.seed`.

A lane whose steps run asynchronously (a GPU's) may overlap them with the host's work: with `overlap` true it
also takes `launch` (a step of decode rows, its tokens not read), `launch_next` (the step after the last one
launched, over the same sequences in the same rows each one row on, fed the tokens that one picks, which the
host has not read: their ids are `PICKED`), `collect` (the oldest launched step's tokens) and `discard`; the
engine keeps at most two steps in flight. A lane keeps its per-sequence state right however many steps it ran
for a sequence the engine then dropped (`forget` follows for an ended one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fuselane.engine.blocks import BlockTable
from fuselane.runtime.sampling import Sampler

PICKED = -1  # the id of a row planned ahead: the token the step before picks, not read yet (`launch_next`)


@dataclass(frozen=True, slots=True)
class Work:
    """One sequence's share of a step."""

    seq: int  # the sequence's id: a lane may keep per-sequence state under it (a device sampler's generator)
    ids: tuple[int, ...]  # tokens fed at positions pos .. pos + len - 1
    pos: int
    table: BlockTable
    sampler: Sampler | None  # picks the token after the last of `ids`; None: a prefill chunk that samples nothing

    @property
    def samples(self) -> bool:
        return self.sampler is not None


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Bytes of the accelerator's memory in all, and in use before the pool is allocated (a lane that makes
    buffers or copies on its first prefill has made them by then)."""

    total: int
    used: int


class PagedLane(Protocol):
    """A lane running steps of many sequences over a paged KV pool."""

    name: str

    def step(self, works: Sequence[Work]) -> list[int | None]: ...

    def warm(self, max_seqs: int, chunk: int) -> int:
        """Make ready, before the first request, every step serving at most `max_seqs` sequences with prefill
        chunks of at most `chunk` rows can run (a lane that builds, compiles or captures steps on their first
        run does it now, so no request waits on it); returns how many steps it made ready."""
        ...

    def forget(self, seq: int) -> None:
        """The sequence has ended: drop what the lane kept for it."""
        ...

    def device_bytes(self) -> int:
        """Bytes the lane's allocations hold on its device now (0 for a lane in host memory): what a load test
        reads to see memory back at its idle level once every sequence has ended."""
        ...


class PagedLaneType(Protocol):
    """The class of a paged lane: what the pool's sizing asks before the lane exists, and how to build it."""

    @staticmethod
    def block_bytes(lane: Any, block_size: int) -> int: ...

    @staticmethod
    def device_memory(lane: Any) -> DeviceMemory | None: ...

    def __call__(self, lane: Any, blocks: int, block_size: int, *, overlap: bool = True) -> PagedLane:
        """The paged form over `lane`; `overlap`: its decode steps overlap the host's work where the lane can
        (`PagedLane`'s module: `launch`), which changes no token."""
        ...
