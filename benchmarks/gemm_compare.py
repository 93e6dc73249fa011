"""Time the prefill products of a 256-row chunk: the GEMM that dequantizes in the kernel (`gemm`, at several
tiles) against cuBLAS on a dequantized f16 copy (what the lane ran before), in TFLOP/s, each launch replayed
from a CUDA graph so no host time counts.

Usage: python benchmarks/gemm_compare.py   (on a GPU)
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from benchmarks.gemv_compare import timed
from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.run.stored import stored_bytes
from fuselane.lanes.cuda.triton import gemm as G
from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize

ROWS = 256  # the lane's prefill chunk
SHAPES = [  # (name, format, n, k)
    ("8b q/o", Format.Q4_K, 4096, 4096),
    ("8b gate", Format.Q4_K, 12288, 4096),
    ("8b down", Format.Q6_K, 4096, 12288),
    ("7b gate", Format.Q4_K, 18944, 3584),
    ("0.5b gate", Format.Q5_0, 4864, 896),
    ("0.6b gate", Format.Q8_0, 3072, 1024),
]
TILES = [(64, 32), (32, 64), (64, 64), (128, 32), (32, 32)]


def main() -> None:
    rng = np.random.default_rng(0)
    for name, fmt, n, k in SHAPES:
        raw = random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng)
        w = torch.from_numpy(stored_bytes(fmt, raw, k // LAYOUTS[fmt].values * LAYOUTS[fmt].nbytes)).cuda()
        x = torch.randn(ROWS, k, device="cuda")
        dense = dequantize(w, fmt, n, k, torch.empty((n, k), dtype=torch.float16, device="cuda"))
        want = (x.half() @ dense.T).float()
        flops = 2 * ROWS * n * k
        cublas = timed(lambda: (x.half() @ dense.T).float())  # noqa: B023
        row = [f"cuBLAS f16 copy {flops / cublas / 1e12:6.1f}"]
        out = torch.empty((ROWS, n), device="cuda")
        for bm, bn in TILES:
            launch = functools.partial(G.gemm, x, w, fmt, n, k, out, block_m=bm, block_n=bn)
            try:
                took = timed(launch)
            except Exception as e:  # a tile that does not compile or fit is reported, not fatal
                row.append(f"{bm}x{bn}: {type(e).__name__}")
                continue
            err = float((out - want).abs().max() / want.abs().max())
            row.append(f"{bm}x{bn}: {flops / took / 1e12:6.1f}" + ("" if err < 1e-3 else f" (diff {err:.0e})"))
        print(f"{name:10} {fmt.name:5} {n}x{k} TFLOP/s: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
