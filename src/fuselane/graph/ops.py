"""Primitive op specs: what one unfused step of a model computes, with the shapes it computes it at.

A spec is a small frozen dataclass; an op of the graph carries one as its symbol. Shapes are concrete for a
graph's form (a decode step is one row, a prefill chunk `rows` rows). Conventions: activations are row-major
`(rows, cols)`; a product multiplies `x (m, k)` by checkpoint rows `W (n, k)` into `y (m, n)`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ElementwiseOp(enum.Enum):
    ADD = "add"
    MUL = "mul"


class UnaryOp(enum.Enum):
    SILU = "silu"


@dataclass(frozen=True, slots=True)
class RowsGather:
    """out[i] = table[ids[i]]: the embedding lookup. ins: table (vocab, cols), ids (rows,)."""

    rows: int
    cols: int


@dataclass(frozen=True, slots=True)
class RmsNorm:
    """out = x / sqrt(mean(x^2) + eps) over each `cols`-wide unit; `rows` units (rows * heads for per-head)."""

    rows: int
    cols: int
    eps: float


@dataclass(frozen=True, slots=True)
class Elementwise:
    """out = a (op) b; with `row` the second operand is one `cols`-wide row broadcast over every unit."""

    op: ElementwiseOp
    rows: int
    cols: int
    row: bool = False


@dataclass(frozen=True, slots=True)
class Unary:
    """out = f(x) elementwise."""

    op: UnaryOp
    rows: int
    cols: int


@dataclass(frozen=True, slots=True)
class Matmul:
    """y (m, n) = x (m, k) @ W (n, k)^T: a product by a weight stored as checkpoint rows (a GEMV when m == 1)."""

    m: int
    n: int
    k: int


@dataclass(frozen=True, slots=True)
class Rope:
    """Rotary position embedding of `heads` heads of `hd` values in each of `rows` rows, the i-th row at
    position pos + i (ins: x, pos). `half` pairs value j with j + hd/2 (NEOX order, as Qwen rotates)."""

    rows: int
    heads: int
    hd: int
    base: float
    half: bool = True


@dataclass(frozen=True, slots=True)
class SetRow:
    """Write `rows` rows of `cols` values into a table at rows pos .. pos + rows - 1 (ins: x, pos); the op's
    destination names the table and the row."""

    rows: int
    cols: int


@dataclass(frozen=True, slots=True)
class Attention:
    """Causal grouped-query attention of `rows` query rows at positions pos .. pos + rows - 1 over the first
    pos + rows rows of the key and value caches (ins: q (rows, heads*hd), k cache, v cache, pos); the cache
    holds `len` rows of `kv_heads * hd`. Query head h reads key/value head h // (heads // kv_heads)."""

    rows: int
    heads: int
    kv_heads: int
    hd: int
    len: int
    scale: float


@dataclass(frozen=True, slots=True)
class TakeRows:
    """The last `take` of `rows` rows: a prefill chunk needs logits only for the row that samples."""

    rows: int
    cols: int
    take: int


PrimSpec = RowsGather | RmsNorm | Elementwise | Unary | Matmul | Rope | SetRow | Attention | TakeRows
