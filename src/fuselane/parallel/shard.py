"""Which part of each axis a rank owns: heads, hidden widths, experts and vocabulary rows.

Heads, hidden widths and experts split evenly (a rank that held more would wait on the others at every
all-reduce; an uneven head split would also break the grouping of query heads over kv heads), and a model
whose counts do not divide is refused by name. The vocabulary splits as evenly as it can (the first ranks
take one row more), since vocabularies are rarely a multiple of the rank count.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuselane.errors import ModelError


@dataclass(frozen=True, slots=True)
class Span:
    """Entries lo .. lo + count - 1 of an axis."""

    lo: int
    count: int

    @property
    def hi(self) -> int:
        return self.lo + self.count


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `tp`: its vocabulary rows of `vocab` and its experts (of a mixture's `experts`)."""

    tp: int
    rank: int
    vocab: Span
    full_vocab: int
    experts: Span  # empty for a dense model


def even(total: int, tp: int, rank: int, what: str) -> Span:
    """Rank `rank`'s equal part of `total` entries, or a ModelError naming `what` where they do not divide."""
    if total % tp:
        raise ModelError(f"--tp {tp} cannot split the model's {total:,} {what} evenly")
    part = total // tp
    return Span(rank * part, part)


def uneven(total: int, tp: int, rank: int) -> Span:
    """Rank `rank`'s part of `total` rows, the first `total % tp` ranks one row more."""
    base, extra = divmod(total, tp)
    lo = rank * base + min(rank, extra)
    return Span(lo, base + (rank < extra))


def check_ranks(tp: int, rank: int) -> None:
    if tp < 1 or not 0 <= rank < tp:
        raise ModelError(f"rank {rank} of --tp {tp}: --tp is at least 1 and a rank is 0 .. tp - 1")
