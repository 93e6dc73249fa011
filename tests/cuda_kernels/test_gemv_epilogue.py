"""`gemv_epilogue`'s launches against NumPy: the product that norms its row in its last block, in f64, and the
device decode of whole matrices against `fuselane.gguf.dequant`, bit for bit.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (small shapes); with one they run on the
device, and the `cuda` tests add a real shape and a CUDA graph replayed with one counter.

The tolerances are derived, as in test_gemv.py (u = 2^-24, gamma_j = j u / (1 - j u)):
- sum_out = x @ W^T + residual: the decoded weights are exactly dequant's, so only the dot product's k
  products and k - 1 sums round (within gamma_k * sum_i |w_i x_i|), and the residual's add once more:
  |s_kernel - s_exact| <= gamma_{k+1} * (sum_i |w_i x_i| + |residual|).
- out = s * rsqrt(mean(s^2) + eps) * w, checked against the norm of the sum_out the kernel wrote (the row the
  last program reads back): the squares and their sum in any order are within gamma_n relative (all terms
  non-negative), the mean, eps's own f32 rounding and the add three more u; the square root halves that; a
  GPU's approximate rsqrt adds APPROX u and the two products 2u; one u more covers the second-order terms.
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
    gamma,
    host,
    norm_rel,
    raw_weights,
    within,
)

from fuselane.gguf.dequant import dequantize as reference_dequantize  # noqa: E402
from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.plan import kernels  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import epilogue as epi  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize, gemv_add_norm, gemv_add_norm_counter  # noqa: E402

ALL = (
    Format.F32,
    Format.F16,
    Format.BF16,
    Format.Q8_0,
    Format.Q4_0,
    Format.Q4_1,
    Format.Q5_0,
    Format.Q5_1,
    Format.Q4_K,
    Format.Q5_K,
    Format.Q6_K,
)
# the whole-matrix decode takes these too: the int8 GEMV's formats that the GEMVs by rows do not decode
DECODED = ALL + (Format.Q2_K, Format.Q3_K, Format.IQ4_NL, Format.IQ4_XS, Format.MXFP4)
N, K = 256, 512  # a norm of 256 values; two K super-blocks a row, so every format's loop takes several steps


class _Case:
    """A decode step's projection, residual and norm weights, with the exact sum in f64."""

    def __init__(self, fmt: Format, n: int, k: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.fmt, self.n, self.k = fmt, n, k
        self.raw = raw_weights(fmt, n, k, rng)
        self.x = rng.standard_normal((1, k)).astype(np.float32)
        self.res = rng.standard_normal(n).astype(np.float32)
        self.norm_w = rng.standard_normal(n).astype(np.float32)
        self.w64 = reference_dequantize(self.raw, fmt, (n, k), np.float64)

    def exact_sum(self, x: np.ndarray, res: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(x @ W^T + res exactly, the bound of the kernel's f32 sum)."""
        x64 = x.astype(np.float64)
        scale = (np.abs(x64) @ np.abs(self.w64).T).reshape(-1)
        return (x64 @ self.w64.T).reshape(-1) + res, gamma(self.k + 1) * (scale + np.abs(res))

    def check_norm(self, sums: torch.Tensor, out: torch.Tensor, rel: float, tiny: float = 0.0) -> None:
        """out is the weighted RMS norm of the row sum_out holds, within `rel` relative and `tiny` absolute."""
        s = host(sums)
        want = s / np.sqrt(np.mean(s * s) + EPS) * self.norm_w
        within(host(out), want, rel * np.abs(want) + tiny, "norm")


@pytest.mark.parametrize(
    ("fmt", "out_dtype"),
    [
        (Format.Q4_K, torch.float32),
        (Format.Q8_0, torch.float32),
        (Format.Q6_K, torch.float16),
        (Format.Q5_0, torch.float32),
    ],
    ids=lambda v: getattr(v, "name", str(v).removeprefix("torch.")),
)
def test_add_norm_is_one_launch(fmt: Format, out_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    case = _Case(fmt, N, K, int(fmt))
    sums = torch.full((1, N), float("nan"), device=DEVICE)
    out = torch.full((1, N), float("nan"), device=DEVICE, dtype=out_dtype)
    counter = gemv_add_norm_counter(DEVICE)
    count = CountLaunches(epi._gemv_add_norm_kernel)
    monkeypatch.setattr(epi, "_gemv_add_norm_kernel", count)
    block_n, _ = epi.norm_tile(fmt, N, K)
    assert N // block_n > 1  # several programs: the norm is the last one's, not the only one's

    got = gemv_add_norm(dev(case.x), dev(case.raw), fmt, N, K, dev(case.res), sums, dev(case.norm_w), EPS, out, counter)

    assert got is out and count.launches == 1
    want, bound = case.exact_sum(case.x, case.res)
    within(host(sums), want, bound, "sum_out")
    if out_dtype == torch.float16:  # one more rounding: relative for normal values, absolute for subnormal ones
        case.check_norm(sums, out, norm_rel(N) + U16, F16_TINY_STEP / 2)
    else:
        case.check_norm(sums, out, norm_rel(N))
    assert counter.item() == 0  # re-armed by the last program


def test_add_norm_in_place_and_replayed() -> None:
    # sum_out is the residual stream itself; the second launch reuses the counter the first one left at zero
    # (without the reset its last program would count past the grid and write no norm: out stays NaN)
    case = _Case(Format.Q4_K, N, K, 90)
    stream = dev(case.res).clone()  # on the CPU dev shares the array's memory
    counter = gemv_add_norm_counter(DEVICE)
    raw, norm_w = dev(case.raw), dev(case.norm_w)
    res = case.res.astype(np.float64)
    for step in range(2):
        x = case.x if step == 0 else np.random.default_rng(91).standard_normal((1, K)).astype(np.float32)
        out = torch.full((N,), float("nan"), device=DEVICE)
        gemv_add_norm(dev(x).reshape(K), raw, Format.Q4_K, N, K, stream, stream, norm_w, EPS, out, counter)
        want, bound = case.exact_sum(x, res)
        within(host(stream), want, bound, f"stream, launch {step}")
        case.check_norm(stream, out, norm_rel(N))
        assert counter.item() == 0, f"launch {step} left the counter at {counter.item()}"
        res = host(stream)  # the next step adds to what this one wrote


@pytest.mark.parametrize("fmt", [Format.Q5_0, Format.Q4_K, Format.Q5_K], ids=lambda f: f.name)
def test_add_norm_walks_a_norm_wider_than_its_chunk(fmt: Format) -> None:
    # a norm of 200 values in chunks of 64 (the last one partial): the squares summed a chunk at a time, then
    # every chunk read back and scaled, as a 14B's 5,120 values are in a block that holds 4,096
    n = 200
    case = _Case(fmt, n, K, 31 + int(fmt))
    sums = torch.full((1, n), float("nan"), device=DEVICE)
    out = torch.full((1, n), float("nan"), device=DEVICE)
    counter = gemv_add_norm_counter(DEVICE)
    gemv_add_norm(dev(case.x), dev(case.raw), fmt, n, K, dev(case.res), sums, dev(case.norm_w), EPS, out, counter,
                  norm_chunk=64)  # fmt: skip
    want, bound = case.exact_sum(case.x, case.res)
    within(host(sums), want, bound, "sum_out")
    case.check_norm(sums, out, norm_rel(n))
    assert counter.item() == 0


def test_add_norm_takes_a_norm_past_what_its_block_holds() -> None:
    # a narrow Q4_0 product (rows of one block) takes a row a warp in eight warps: 256 threads hold 8,192
    # values, and a norm one block wider is walked in two chunks
    fmt, k = Format.Q4_0, 32
    threads = kernels.gemv_blk_norm_threads(kernels.rows_a_warp(fmt, 1, k, 1))
    n = threads * kernels.NORM_HELD_A_THREAD + k
    case = _Case(fmt, n, k, 77)
    sums, out = torch.empty((1, n), device=DEVICE), torch.empty((1, n), device=DEVICE)
    counter = gemv_add_norm_counter(DEVICE)
    gemv_add_norm(dev(case.x), dev(case.raw), fmt, n, k, dev(case.res), sums, dev(case.norm_w), EPS, out, counter)
    want, bound = case.exact_sum(case.x, case.res)
    within(host(sums), want, bound, "sum_out")
    case.check_norm(sums, out, norm_rel(n))


# the anchors' (hidden width, widest input) of a layer's o and down projections
NORMED_PRODUCTS = [(896, 896), (896, 4864), (1024, 3072), (3584, 18944), (4096, 12288), (5120, 5120), (16384, 1024)]


@pytest.mark.parametrize("fmt", [Format.Q4_K, Format.Q6_K, Format.Q5_0, Format.Q8_0], ids=lambda f: f.name)
def test_norm_tile_is_the_block_the_shim_fuses_by(fmt: Format) -> None:
    # a block format's block is gemv_blk_norm_threads of its rows a warp (the GEMV's own tile), a Q8_0
    # projection's at least the norm's own threads
    for n, k in NORMED_PRODUCTS:
        block_n, warps = epi.norm_tile(fmt, n, k)
        per_warp = kernels.rows_a_warp(fmt, n, k, 1)
        assert block_n == per_warp * warps
        if fmt is Format.Q8_0:
            shim_threads = kernels.norm_threads(n)
            assert warps * kernels.WARP >= shim_threads
        else:
            shim_threads = kernels.gemv_blk_norm_threads(per_warp)
            assert warps * kernels.WARP == shim_threads


# --- the whole-matrix decode ---------------------------------------------------------------------------------------


def test_every_format_the_lane_decodes_is_tested() -> None:
    assert set(DECODED) == kernels.DEQUANT_FORMATS
    assert set(kernels.DEQUANT_TILES) <= kernels.DEQUANT_FORMATS


@pytest.mark.parametrize("values_warps", [None, (1024, 2)], ids=["plan", "small"])
@pytest.mark.parametrize("fmt", DECODED, ids=lambda f: f.name)
def test_dequantize_is_the_reference(fmt: Format, values_warps: tuple[int, int] | None) -> None:
    # at the format's tile (`kernels.dequant_tile`) and at a smaller one, as the sweep runs it
    n = 36  # not a whole program's units: the last program's units past the end are dropped
    raw = raw_weights(fmt, n, K, np.random.default_rng(100 + int(fmt)))
    want = reference_dequantize(raw, fmt, (n, K))
    w = dev(raw)

    out = torch.full((n, K), float("nan"), device=DEVICE)
    assert dequantize(w, fmt, n, K, out, values_warps=values_warps) is out
    got = out.cpu().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "f32 values differ from dequant's"

    # f16: the same values rounded once to nearest even (NumPy's astype rounds so too), in a wider table
    table = torch.zeros((n, K + 64), device=DEVICE, dtype=torch.float16)
    dequantize(w, fmt, n, K, table[:, :K], values_warps=values_warps)
    half = table.cpu().numpy()
    assert np.array_equal(half[:, :K].view(np.uint16), want.astype(np.float16).view(np.uint16))
    assert not half[:, K:].any(), "wrote past the rows' k values"


@pytest.mark.parametrize("fmt", [Format.F32, Format.BF16], ids=lambda f: f.name)
def test_dequantize_float_rows_of_any_length(fmt: Format) -> None:
    # a float row need not be whole 32-value runs: 100 values decode in runs of 4
    n, k = 5, 100
    raw = raw_weights(fmt, n, k, np.random.default_rng(110))
    out = torch.empty((n, k), device=DEVICE)
    dequantize(dev(raw), fmt, n, k, out)
    assert np.array_equal(out.cpu().numpy().view(np.uint32), reference_dequantize(raw, fmt, (n, k)).view(np.uint32))


def test_dequantize_refuses_a_wrong_out() -> None:
    raw = dev(raw_weights(Format.Q8_0, 4, 64, np.random.default_rng(120)))
    for bad in (torch.empty((4, 64), dtype=torch.bfloat16), torch.empty((4, 32)), torch.empty((64, 4)).t()):
        with pytest.raises(ValueError, match="out must be"):
            dequantize(raw, Format.Q8_0, 4, 64, bad.to(DEVICE))


# --- on a GPU only --------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_real_add_norm_replayed_in_a_cuda_graph() -> None:
    # a 4096-wide Q4_K o projection: 256 programs race to be last; the graph replays with the counter it captured
    n = k = 4096
    case = _Case(Format.Q4_K, n, k, 130)
    x, raw, norm_w = dev(case.x), dev(case.raw), dev(case.norm_w)
    stream = dev(case.res).clone()
    out = torch.empty(n, device=DEVICE)
    counter = gemv_add_norm_counter(DEVICE)
    gemv_add_norm(x, raw, Format.Q4_K, n, k, stream, stream, norm_w, EPS, out, counter)  # compile outside capture
    torch.cuda.synchronize()
    stream.copy_(dev(case.res))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_add_norm(x, raw, Format.Q4_K, n, k, stream, stream, norm_w, EPS, out, counter)
    stream.copy_(dev(case.res))
    res = case.res.astype(np.float64)
    for replay in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, bound = case.exact_sum(case.x, res)
        within(host(stream), want, bound, f"stream, replay {replay}")
        case.check_norm(stream, out, norm_rel(n))
        assert counter.item() == 0
        res = host(stream)
