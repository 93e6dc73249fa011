"""`gemv_fast_add_norm` against NumPy in f64: the fast decode GEMV whose last program norms the row it wrote.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (small shapes); with one it runs on the
device, and the `cuda` test adds real shapes captured in a CUDA graph replayed with one counter. The
interpreter runs programs one after another, so it checks the arithmetic, the last-program election and the
counter's reset, not the memory ordering (gemv_fast_norm's comments argue that).

The tolerances are derived, as in test_gemv_fast.py and test_gemv_epilogue.py (u = 2^-24,
gamma_j = j u / (1 - j u)):
- sum_out = x @ W^T + residual: every weight decodes to exactly dequant's f32 value, so only the dot product's
  k products and k - 1 sums round (within gamma_k * sum_i |w_i x_i|, Higham 3.1), and the residual's add once
  more: |s_kernel - s_exact| <= gamma_{k+1} * (sum_i |w_i x_i| + |residual|).
- out = s * rsqrt(mean(s^2) + eps) * w, checked against the norm of the sum_out the kernel wrote (the row the
  last program reads back): the squares and their sum in any order (chunked or not) are within gamma_n
  relative (all terms non-negative), the mean, eps's own f32 rounding and the add three more u; the square
  root halves that; a GPU's approximate rsqrt adds APPROX u and the two products 2u; one u more covers the
  second-order terms. An f16 out rounds once more.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import (  # noqa: E402
    CUDA,
    DEVICE,
    EPS,
    F16_TINY_STEP,
    U16,
    CountLaunches,
    dev,
    file_blocks,
    gamma,
    host,
    norm_rel,
    within,
)

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import LAYOUTS, Format  # noqa: E402
from fuselane.gguf.quantize import random_blocks  # noqa: E402
from fuselane.lanes.cuda.plan import kernels  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import fast_norm as fnorm  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.epilogue import gemv_add_norm_counter  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.fast_norm import gemv_fast_add_norm, supports_fast_add_norm  # noqa: E402

K = 512  # two K super-blocks, or 16 32-value blocks: every format's loop takes a prefetch and a last chunk

# (format, n): widths from 64 to 256, most not whole 8-row tiles (the last tile's extra rows are dropped)
CASES = [(Format.Q4_K, 256), (Format.Q6_K, 100), (Format.Q8_0, 64), (Format.Q5_0, 203), (Format.F16, 150)]


class _Case:
    """A decode step's projection, residual and norm weights; the exact sum comes from `x @ W^T` in f64."""

    def __init__(self, fmt: Format, n: int, k: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.fmt, self.n, self.k = fmt, n, k
        self.raw = file_blocks(fmt, random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng).reshape(-1), k)
        self.x = rng.standard_normal((1, k)).astype(np.float32)
        self.res = rng.standard_normal(n).astype(np.float32)
        self.norm_w = rng.standard_normal(n).astype(np.float32)
        self.product, self.scale = self._product()

    def _product(self) -> tuple[np.ndarray, np.ndarray]:
        """(x @ W^T, sum_i |w_i x_i|) per output, in f64: on the device for real shapes, a slab of rows at a time."""
        x = torch.from_numpy(self.x).to(DEVICE, torch.float64)
        rows = self.raw.reshape(self.n, -1)
        want, scale, slab = [], [], 2048
        for r in range(0, self.n, slab):
            part = rows[r : r + slab]
            w = torch.from_numpy(dequantize(part.reshape(-1), self.fmt, (part.shape[0], self.k), np.float64))
            w = w.to(DEVICE)
            want.append((x @ w.T).cpu().numpy().reshape(-1))
            scale.append((x.abs() @ w.abs().T).cpu().numpy().reshape(-1))
        return np.concatenate(want), np.concatenate(scale)

    def exact_sum(self, res: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(x @ W^T + res exactly, the bound of the kernel's f32 sum)."""
        return self.product + res, gamma(self.k + 1) * (self.scale + np.abs(res))

    def check_norm(self, sums: torch.Tensor, out: torch.Tensor, rel: float, tiny: float = 0.0) -> None:
        """out is the weighted RMS norm of the row sum_out holds, within `rel` relative and `tiny` absolute."""
        s = host(sums)
        want = s / np.sqrt(np.mean(s * s) + EPS) * self.norm_w
        within(host(out), want, rel * np.abs(want) + tiny, "norm")


@pytest.mark.parametrize(("fmt", "n"), CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_each_format(fmt: Format, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    case = _Case(fmt, n, K, int(fmt) + n)
    sums = torch.full((1, n), float("nan"), device=DEVICE)
    out = torch.full((1, n), float("nan"), device=DEVICE)
    counter = gemv_add_norm_counter(DEVICE)
    count = CountLaunches(fnorm._fast_add_norm_kernel)
    monkeypatch.setattr(fnorm, "_fast_add_norm_kernel", count)

    got = gemv_fast_add_norm(
        dev(case.x), dev(case.raw), fmt, n, K, dev(case.res), sums, dev(case.norm_w), EPS, out, counter
    )

    assert got is out and count.launches == 1
    want, bound = case.exact_sum(case.res.astype(np.float64))
    within(host(sums), want, bound, "sum_out")
    case.check_norm(sums, out, norm_rel(n))
    assert counter.item() == 0  # re-armed by the last program


def test_norm_in_chunks_into_f16(monkeypatch: pytest.MonkeyPatch) -> None:
    # the last program walks a 100-wide row 32 values a pass (3 whole chunks and a partial one), into f16
    monkeypatch.setattr(fnorm, "NORM_CHUNK", 32)
    n = 100
    case = _Case(Format.Q6_K, n, K, 7)
    sums = torch.empty(n, device=DEVICE)
    out = torch.full((n,), float("nan"), device=DEVICE, dtype=torch.float16)
    counter = gemv_add_norm_counter(DEVICE)
    gemv_fast_add_norm(dev(case.x).reshape(K), dev(case.raw), Format.Q6_K, n, K, dev(case.res), sums,
                       dev(case.norm_w), EPS, out, counter)  # fmt: skip
    want, bound = case.exact_sum(case.res.astype(np.float64))
    within(host(sums), want, bound, "sum_out")
    # one more rounding: relative for normal values, absolute for subnormal ones
    case.check_norm(sums, out, norm_rel(n) + U16, F16_TINY_STEP / 2)
    assert counter.item() == 0


def test_in_place_and_relaunched_with_one_counter() -> None:
    # sum_out is the residual stream itself; the second launch reuses the counter the first one left at zero
    # (without the reset its last program would count past the grid and write no norm: out would stay NaN)
    n = 120
    case = _Case(Format.Q4_K, n, K, 90)
    stream = dev(case.res).clone()  # on the CPU dev shares the array's memory
    counter = gemv_add_norm_counter(DEVICE)
    x, raw, norm_w = dev(case.x), dev(case.raw), dev(case.norm_w)
    res = case.res.astype(np.float64)
    for step in range(2):
        out = torch.full((n,), float("nan"), device=DEVICE)
        gemv_fast_add_norm(x, raw, Format.Q4_K, n, K, stream, stream, norm_w, EPS, out, counter)
        want, bound = case.exact_sum(res)
        within(host(stream), want, bound, f"stream, launch {step}")
        case.check_norm(stream, out, norm_rel(n))
        assert counter.item() == 0, f"launch {step} left the counter at {counter.item()}"
        res = host(stream)  # the next launch adds the same product to what this one wrote


def test_supports_and_refusals() -> None:
    for fmt, _ in CASES:
        assert supports_fast_add_norm(fmt, 1) and supports_fast_add_norm(fmt, 151936)
    assert not supports_fast_add_norm(Format.Q4_K, 4096, m=2)
    assert not supports_fast_add_norm(Format.Q5_K, 4096)
    assert not supports_fast_add_norm(Format.Q4_0, 4096)
    row = torch.zeros(8, device=DEVICE)
    w = torch.zeros(8 * kernels.stored_row_bytes(Format.Q8_0, 32), dtype=torch.uint8, device=DEVICE)  # 8 rows
    args = (torch.zeros(1, 32, device=DEVICE), w, Format.Q8_0, 8, 32, row, row, row, EPS, row.clone())
    with pytest.raises(ValueError, match="counter"):
        gemv_fast_add_norm(*args, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="no fast GEMV"):
        gemv_fast_add_norm(*args[:2], Format.Q4_0, *args[3:], gemv_add_norm_counter(DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        gemv_fast_add_norm(*args[:-1], torch.zeros(9, device=DEVICE), gemv_add_norm_counter(DEVICE))


# --- on a GPU only --------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(("fmt", "n", "k"), [(Format.Q6_K, 4096, 12288), (Format.Q4_K, 4096, 4096)],
                         ids=lambda v: getattr(v, "name", str(v)))  # fmt: skip
def test_real_shape_replayed_in_a_cuda_graph(fmt: Format, n: int, k: int) -> None:
    # a 4096-wide down / o projection: 512 programs race to be last; the graph replays with the counter it captured
    case = _Case(fmt, n, k, 130)
    x, raw, norm_w = dev(case.x), dev(case.raw), dev(case.norm_w)
    stream = dev(case.res).clone()
    out = torch.empty(n, device=DEVICE)
    counter = gemv_add_norm_counter(DEVICE)
    gemv_fast_add_norm(x, raw, fmt, n, k, stream, stream, norm_w, EPS, out, counter)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_fast_add_norm(x, raw, fmt, n, k, stream, stream, norm_w, EPS, out, counter)
    stream.copy_(dev(case.res))
    res = case.res.astype(np.float64)
    for replay in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, bound = case.exact_sum(res)
        within(host(stream), want, bound, f"stream, replay {replay}")
        case.check_norm(stream, out, norm_rel(n))
        assert counter.item() == 0
        res = host(stream)
