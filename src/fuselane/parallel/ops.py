"""The primitives a rank's graph adds: where its partial results meet the other ranks', and where it reads
only its own vocabulary rows or experts. Each is what the unsplit model computes once every rank has run it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AllReduce:
    """out (rows, cols) = the sum over the ranks of x (rows, cols): the partial products of the attention
    output and of the down projection (each rank's heads, hidden columns or experts) made whole."""

    rows: int
    cols: int


@dataclass(frozen=True, slots=True)
class AllGather:
    """out (rows, cols): every rank's x (rows, width) placed at its columns lo .. lo + width - 1: the logits of
    each rank's vocabulary rows laid side by side."""

    rows: int
    cols: int
    lo: int
    width: int


@dataclass(frozen=True, slots=True)
class ShardGather:
    """out (rows, cols): the table's row ids[i] - lo where rank holds that token (lo .. lo + count - 1), zero
    where another rank does (ins: table (count, cols), ids (rows,)); summed over the ranks, the embedding."""

    rows: int
    cols: int
    lo: int
    count: int


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """A row's kept experts as the rank holds them (experts lo .. lo + count - 1): with `weights`, the routing
    weights with the other ranks' experts' zeroed (ins: weights (rows, k), ids (rows, k)); without, the ids
    made local, another rank's expert read as local expert 0 (its product is weighted by zero)."""

    rows: int
    k: int
    lo: int
    count: int
    weights: bool


COLLECTIVES = (AllReduce, AllGather)
