"""Views of a batch of GGUF blocks that every decoder reads through (`dequant`, `dequant_grid`): a field by name,
an f16 scale as f32, packed bytes as their nibbles. Offsets come from `formats.LAYOUTS`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fuselane.gguf.formats import BlockLayout

Decoder = Callable[[np.ndarray, np.ndarray], None]
"""Decodes blocks (n, layout.nbytes) uint8 into out (n, layout.values) float32, in place."""


def field(blocks: np.ndarray, lay: BlockLayout, name: str) -> np.ndarray:
    """Field `name` of every block, as an (n, count) view in the field's dtype."""
    f = lay.field(name)
    return blocks[:, f.offset : f.offset + f.nbytes].view(f.dtype)


def scale(blocks: np.ndarray, lay: BlockLayout, name: str = "d") -> np.ndarray:
    return field(blocks, lay, name).astype(np.float32)


def nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Bytes (n, k * group) as codes (n, k, 2, group): each group's low nibbles, then its high nibbles."""
    # a packed copy first: NumPy's loops over short strided rows cost more than the copy does
    g = np.ascontiguousarray(qs).reshape(qs.shape[0], -1, group)
    codes = np.empty((qs.shape[0], g.shape[1], 2, group), dtype=np.uint8)
    np.bitwise_and(g, 0x0F, out=codes[:, :, 0])
    np.right_shift(g, 4, out=codes[:, :, 1])
    return codes
