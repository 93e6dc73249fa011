"""Time a 7B Q4_K_M's prefill products (512 rows) on a GPU: cuBLAS on the f16 copy (`f16_scale.product`, the
default: its rounding launch, cuBLAS, its epilogue) against the super-block GEMM (`gemm_sb.product`: its
activation launch and the GEMM, at a few tiles) and the older in-kernel GEMM (`gemm.gemm`), in TFLOP/s and us,
each launch replayed from a CUDA graph so no host time counts. Each result is checked against cuBLAS's.

Usage: python benchmarks/gemm_sb_compare.py [--rows 512]   (on a GPU)
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import torch

from benchmarks.gemv_compare import timed
from fuselane.gguf.formats import LAYOUTS, QK, Format
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.run.stored import stored_bytes
from fuselane.lanes.cuda.triton import f16_scale, f16_sums
from fuselane.lanes.cuda.triton import gemm as G
from fuselane.lanes.cuda.triton import gemm_sb as SB
from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize

SHAPES = [  # (name, format, n, k): Qwen2.5-7B's products in its Q4_K_M mix
    ("q/o", Format.Q4_K, 3584, 3584),
    ("k/v", Format.Q4_K, 512, 3584),
    ("gate/up", Format.Q4_K, 18944, 3584),
    ("down", Format.Q6_K, 3584, 18944),
]
TILES = [(128, 128), (64, 128), (128, 64)]  # activation rows x weight rows; each compiles without a spill
TOLERANCE = 1e-2  # a wrong result differs by about its own size; f16 rounding of the weights by ~1e-3


def _gemm_sb(x, w, fmt, n, k, out, tile):
    """The super-block GEMM alone at `tile`, its activation (f16 rows, scales, sums) made before the timing."""
    m = x.shape[0]
    x16, s = torch.empty((m, k), dtype=torch.float16, device="cuda"), torch.empty(m, device="cuda")
    sums = torch.empty((m, k // QK * 2), dtype=torch.float16, device="cuda")
    f16_sums.f16_sums(x, x16, s, sums)
    return functools.partial(SB.gemm_sb, x16, s, sums if fmt is Format.Q4_K else None, w, fmt, n, k, out,
                             block_m=tile[0], block_n=tile[1])  # fmt: skip


def _cell(label: str, launch, out: torch.Tensor, want: torch.Tensor, flops: int) -> str:
    try:
        took = timed(launch)
    except Exception as e:  # a tile that does not compile or fit is reported, not fatal
        return f"{label}: {type(e).__name__}"
    err = float((out - want).abs().max() / want.abs().max())
    wrong = "" if err < TOLERANCE else f" diff {err:.0e}"
    return f"{label}: {flops / took / 1e12:6.1f} ({took * 1e6:7.1f} us){wrong}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    rows = ap.parse_args().rows
    rng = np.random.default_rng(0)
    for name, fmt, n, k in SHAPES:
        raw = random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng)
        w = torch.from_numpy(stored_bytes(fmt, raw, k // LAYOUTS[fmt].values * LAYOUTS[fmt].nbytes)).cuda()
        x = torch.randn(rows, k, device="cuda")
        dense = dequantize(w, fmt, n, k, torch.empty((n, k), dtype=torch.float16, device="cuda"))
        out, want = torch.empty((rows, n), device="cuda"), torch.empty((rows, n), device="cuda")
        flops = 2 * rows * n * k
        # the reference: cuBLAS's result, which each other cell is checked against
        cells = [_cell("cuBLAS f16 copy", lambda: f16_scale.product(x, dense, want), want, want, flops)]  # noqa: B023
        cells.append(_cell("gemm_sb.product", functools.partial(SB.product, x, w, fmt, n, k, out), out, want, flops))
        cells += [_cell(f"sb {t[0]}x{t[1]}", _gemm_sb(x, w, fmt, n, k, out, t), out, want, flops) for t in TILES]
        cells.append(_cell("gemm 64x32", functools.partial(G.gemm, x, w, fmt, n, k, out), out, want, flops))
        print(f"{name:8} {fmt.name:5} {n}x{k} TFLOP/s: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
