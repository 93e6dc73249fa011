"""NumPy forms of word-level instructions for Triton's interpreter (`TRITON_INTERPRET=1`, CI without a GPU).

Why: a kernel's inline PTX has no interpreted form, and spelling a `dp4a` in Triton's integer ops costs about
twenty interpreted operations, each a Python round trip over a small array; the int8 GEMVs spent most of their
interpreted time there. Here the same sums are one NumPy expression over the tensors' arrays, so they equal what
the instruction sums, byte for byte.

Each form is wrapped as a `tl.constexpr` whose text is its name: a kernel names it only in a branch taken when
interpreted, and the compiled kernels' cache keys (which include every constexpr global's text) stay the same
from one process to the next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import triton.language as tl

WORD_BYTES = 4


@dataclass(frozen=True, slots=True)
class _Form:
    """A NumPy function callable from an interpreted kernel; its text is its name."""

    name: str
    fn: Callable

    def __call__(self, *args):
        return self.fn(*args)

    def __repr__(self) -> str:
        return self.name


def _bytes_of(t, signed: bool) -> np.ndarray:
    """An int32 tensor's words as their four bytes, [..., 4] int32 (little-endian, as the GPU's)."""
    data = np.ascontiguousarray(t.handle.data, dtype=np.int32)
    view = data.reshape(-1).view(np.int8 if signed else np.uint8)
    return view.reshape(data.shape + (WORD_BYTES,)).astype(np.int32)


def _tensor(data: np.ndarray):
    """An int32 block tensor holding `data` (the interpreter's tensors are their arrays)."""
    from triton.runtime.interpreter import TensorHandle

    return tl.core.tensor(TensorHandle(data.astype(np.int32), tl.int32), tl.block_type(tl.int32, list(data.shape)))


def _dp4a(a, b, c, signed):
    """c + the dot of a's four bytes (signed where `signed`, else unsigned) with b's four signed bytes."""
    sums = (_bytes_of(a, bool(signed)) * _bytes_of(b, True)).sum(-1, dtype=np.int64)
    return _tensor(c.handle.data.astype(np.int64) + sums)


def _dot16(w, a, signed):
    """[N, G, 4] words of codes times [N, G, 4] words of signed activations: [N, G] int32 of 16-value dots."""
    return _tensor((_bytes_of(w, bool(signed)) * _bytes_of(a, True)).sum((-2, -1), dtype=np.int64))


DP4A = tl.constexpr(_Form("interpreted.dp4a", _dp4a))
DOT16 = tl.constexpr(_Form("interpreted.dot16", _dot16))
