"""Cut a quantized tensor into parts without decoding it.

A GGUF row is whole blocks (`formats.LAYOUTS`), so a part of every row is a range of blocks: a split along the
row (a column split: the output and down projections) must fall on block boundaries or it cannot be cut from
the bytes; it is refused with the reason. Splits along the other axes (rows, experts) are byte ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fuselane.errors import ModelError
from fuselane.gguf.formats import LAYOUTS, Format, row_bytes


@dataclass(frozen=True, slots=True)
class Part:
    """A tensor (or a slice of one) as the lanes read tensors: format, numpy-order shape, quantized bytes."""

    name: str
    format: Format
    shape: tuple[int, ...]
    data: np.ndarray = field(compare=False, repr=False)  # 1-D uint8, the part's blocks back to back

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def whole(t) -> Part:
    """A tensor of the file, as a Part (replicated on every rank)."""
    return Part(t.name, t.format, tuple(t.shape), t.data)


def _units(t, axis: int) -> np.ndarray:
    """The tensor's bytes as (units before `axis`, the axis, bytes of one unit past it); `axis` is not the row."""
    shape = tuple(t.shape)
    before = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1 : -1], dtype=np.int64)) * row_bytes(t.format, shape[-1])
    return np.asarray(t.data).reshape(before, shape[axis], inner)


def take(t, axis: int, lo: int, count: int) -> Part:
    """Entries lo .. lo + count - 1 of `axis`: rows of a matrix or a vector, experts of an expert tensor, or
    (the last axis) a range of every row's values, which must be whole blocks."""
    shape = tuple(t.shape)
    axis %= len(shape)
    if not 0 <= lo <= lo + count <= shape[axis]:
        raise ValueError(f"{t.name}: entries {lo}..{lo + count} are outside an axis of {shape[axis]}")
    if axis == len(shape) - 1:
        return _take_columns(t, lo, count)
    data = _units(t, axis)[:, lo : lo + count].reshape(-1)
    return Part(t.name, t.format, (*shape[:axis], count, *shape[axis + 1 :]), np.ascontiguousarray(data))


def column_refusal(fmt: Format, name: str, lo: int, count: int) -> str | None:
    """Why values lo .. lo + count - 1 of every row cannot be cut from `fmt`'s blocks, or None when they can."""
    block = LAYOUTS[fmt].values
    if lo % block or count % block:
        return (
            f"'{name}' splits its rows at {lo} + {count} values, not on the {block}-value blocks of {fmt.name}; "
            f"its rows cannot be cut without dequantizing"
        )
    return None


def _take_columns(t, lo: int, count: int) -> Part:
    why = column_refusal(t.format, t.name, lo, count)
    if why is not None:
        raise ModelError(why)
    lay, shape = LAYOUTS[t.format], tuple(t.shape)
    blocks = np.asarray(t.data).reshape(-1, shape[-1] // lay.values, lay.nbytes)
    data = blocks[:, lo // lay.values : (lo + count) // lay.values].reshape(-1)
    return Part(t.name, t.format, (*shape[:-1], count), np.ascontiguousarray(data))
