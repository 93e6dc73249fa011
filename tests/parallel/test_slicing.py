"""Slices cut from quantized blocks rebuild the matrix they came from, for every format, and a column split
off the blocks' boundaries is refused with its reason."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuselane.errors import ModelError
from fuselane.gguf.dequant import dequantize
from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.gguf.quantize import random_blocks
from fuselane.parallel.shard import uneven
from fuselane.parallel.slicing import Part, take

MAX_BLOCKS = 3  # blocks a row, at most: small tensors keep each example fast


def _tensor(fmt: Format, shape: tuple[int, ...], seed: int) -> Part:
    lay = LAYOUTS[fmt]
    n_blocks = int(np.prod(shape)) // lay.values
    data = random_blocks(fmt, n_blocks, np.random.default_rng(seed)).reshape(-1)
    return Part("w", fmt, shape, data)


def _decoded(p: Part) -> np.ndarray:
    return dequantize(p.data, p.format, p.shape, dtype=np.float64)


@st.composite
def cases(draw):
    """A tensor (a matrix or an expert stack) in some format, an axis to split and a number of parts."""
    fmt = draw(st.sampled_from(list(Format)))
    block = LAYOUTS[fmt].values
    blocks = draw(st.integers(1, MAX_BLOCKS))
    lead = draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))
    shape = (*lead, blocks * block)
    axis = draw(st.integers(0, len(shape) - 1))
    parts = draw(st.integers(1, blocks if axis == len(shape) - 1 else shape[axis]))
    return fmt, shape, axis, parts, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(cases())
def test_the_slices_of_a_tensor_rebuild_it(case) -> None:
    fmt, shape, axis, parts, seed = case
    t = _tensor(fmt, shape, seed)
    last = axis == len(shape) - 1
    block = LAYOUTS[fmt].values if last else 1
    units = shape[axis] // block  # a column split cuts whole blocks
    spans = [uneven(units, parts, r) for r in range(parts)]
    pieces = [take(t, axis, s.lo * block, s.count * block) for s in spans]
    for p, s in zip(pieces, spans, strict=True):
        assert p.shape[axis] == s.count * block and p.nbytes * shape[axis] == t.data.nbytes * p.shape[axis]
    rebuilt = np.concatenate([_decoded(p) for p in pieces], axis=axis)
    np.testing.assert_array_equal(rebuilt, _decoded(t))


@pytest.mark.parametrize("fmt", [Format.Q4_K, Format.Q8_0, Format.Q6_K])
def test_a_column_split_inside_a_block_is_refused_by_name(fmt: Format) -> None:
    block = LAYOUTS[fmt].values
    t = _tensor(fmt, (2, 2 * block), 0)
    with pytest.raises(ModelError, match=rf"'w' splits its rows at {block // 2} .* {fmt.name}"):
        take(t, -1, block // 2, block)
    take(t, -1, block, block)  # on a boundary: cut
