"""What the GEMV kernel tests share: the device, f32/f16 roundoff, the Higham bound gamma_k, the weighted
RMS norm's relative error, random weights, and the checks of a result against its bound.

The bounds are derived in the tests' module docstrings: an f32 sum of k exact products is within
gamma_k * sum |w x| of the exact one (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.run.stored import relaid, stored_bytes

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# the marks of a case too wide for the interpreter: it runs in the GPU run (`-m cuda`) only
GPU_ONLY = (pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU"))
U32 = 2.0**-24  # f32 unit roundoff
U16 = 2.0**-11  # f16 unit roundoff: an f16 result's one rounding, relative (normal values)
F16_TINY_STEP = 2.0**-24  # the spacing of f16's subnormals, where a rounding is within half of it, absolute
APPROX = 4  # a GPU's approximate rsqrt: within 4u (PTX: 2^-22 relative)
EPS = 1e-6
NORM_ROUNDINGS = 3  # the mean's division, eps rounded to f32, and its add
SECOND_ORDER = 1  # a u of room for the products of first-order terms


def gamma(terms: int) -> float:
    return terms * U32 / (1 - terms * U32)


def norm_rel(n: int) -> float:
    """Relative error of one output of the weighted RMS norm of an f32 row of `n`."""
    return gamma(n + NORM_ROUNDINGS) / 2 + (APPROX + 2 + SECOND_ORDER) * U32


class FileBlocks(np.ndarray):
    """A matrix's bytes as the file has them, tagged with their format and a row's bytes (kept by slices and
    reshapes): `dev` puts them on the device as the lane keeps them (`run/stored.py`: Q3_K's blocks in 112
    bytes, Q6_K's, Q8_0's and Q2_K's d's after a row's blocks), while a reference reads them as they are."""

    fmt: Format | None = None
    row_bytes: int | None = None

    def __array_finalize__(self, obj) -> None:
        self.fmt = getattr(obj, "fmt", None)
        self.row_bytes = getattr(obj, "row_bytes", None)


def file_blocks(fmt: Format, data: np.ndarray, k: int | None = None) -> FileBlocks:
    """`data`, a matrix's bytes in `fmt` as the file has them (rows of `k` values, else its last axis's bytes),
    tagged for `dev`."""
    tagged = np.asarray(data).view(FileBlocks)
    tagged.fmt = Format(fmt)
    if k is not None:
        tagged.row_bytes = k // LAYOUTS[tagged.fmt].values * LAYOUTS[tagged.fmt].nbytes
    return tagged


def file_bytes_of(fmt: Format, stored, k: int) -> np.ndarray:
    """The file's bytes of the matrix of rows of `k` values whose bytes as the lane keeps them are `stored` (a
    tensor or array): `stored_bytes` undone, so a reference can read what a kernel was handed."""
    fmt, lay = Format(fmt), LAYOUTS[Format(fmt)]
    flat = np.asarray(stored.cpu().numpy() if isinstance(stored, torch.Tensor) else stored).reshape(-1)
    if not relaid(fmt):
        return flat
    blocks, stride = k // lay.values, kernels.stored_block_bytes(fmt)
    rows = flat.reshape(-1, kernels.stored_row_bytes(fmt, k))
    runs = rows[:, : blocks * stride].reshape(-1, blocks, stride)
    tail = kernels.ROW_TAIL_D.get(fmt)
    if tail is None:
        return np.ascontiguousarray(runs[:, :, : lay.nbytes]).reshape(-1)
    d_at = lay.field("d").offset
    ds = rows[:, blocks * stride : blocks * (stride + tail)].reshape(-1, blocks, tail)
    return np.concatenate([runs[:, :, :d_at], ds, runs[:, :, d_at:]], axis=2).reshape(-1)


def raw_weights(fmt: Format, n: int, k: int, rng: np.random.Generator) -> FileBlocks:
    """n rows of k values of random blocks in `fmt`, as the 1-D bytes a GGUF tensor is."""
    return file_blocks(fmt, random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng).reshape(-1), k)


def dev(a: np.ndarray) -> torch.Tensor:
    """`a` on the device; a matrix's file bytes (`FileBlocks`) as the lane stores them."""
    fmt = getattr(a, "fmt", None)
    if fmt is not None:
        a = stored_bytes(fmt, np.asarray(a), a.row_bytes)
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


def host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy().reshape(-1)


def within(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    """Every value finite and within its bound of the reference."""
    err = np.abs(got - want)
    worst = int(np.argmax(err - bound))
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    assert np.all(err <= bound), f"{what}: error {err[worst]:.3g} over the bound {bound[worst]:.3g} at {worst}"


def check(got: torch.Tensor, want: np.ndarray, bound: np.ndarray) -> None:
    """A device result within its bound of the reference, element by element."""
    err = np.abs(got.detach().cpu().double().numpy() - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"error {err[worst]:.3g} over the bound {bound[worst]:.3g} at {worst}"


class CountLaunches:
    """Stands in for a kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]
