"""Time the int8 prefill GEMM (`gemm_q8`) over candidate tiles against cuBLAS on an f16 copy, on a 512-row chunk.

For each product of the reference shapes (Qwen2.5-7B, Qwen3-8B, the small ones) and each tile of `TILES`
(BLOCK_M, BLOCK_N, warps, stages), prints TFLOP/s (2 m n k a launch, replayed from a CUDA graph) and the
largest difference from the f16-copy product relative to its largest value; the row's best tile is marked.
Write the best ones into `fuselane/lanes/cuda/plan/gemm_tiles.py` (`TILES`, `DEFAULT_TILE`).

Usage: python benchmarks/gemm_q8_sweep.py [--rows 512] [--formats Q4_K,Q6_K]   (on a GPU)
"""

from __future__ import annotations

import argparse
import functools
import itertools

import numpy as np
import torch

from benchmarks.gemv_compare import timed
from fuselane.gguf.formats import LAYOUTS, Format
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.plan.gemm_tiles import GemmTile
from fuselane.lanes.cuda.triton import gemm_q8 as G
from fuselane.lanes.cuda.triton import quant
from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize

SHAPES = [  # (name, format, n, k)
    ("7b q/o", Format.Q4_K, 3584, 3584),
    ("7b gate", Format.Q4_K, 18944, 3584),
    ("7b down", Format.Q6_K, 3584, 18944),
    ("8b gate", Format.Q4_K, 12288, 4096),
    ("8b down", Format.Q6_K, 4096, 12288),
    ("7b gate q5k", Format.Q5_K, 18944, 3584),
    ("7b gate q3k", Format.Q3_K, 18944, 3584),
    ("7b gate iq4xs", Format.IQ4_XS, 18944, 3584),
    ("7b gate q8", Format.Q8_0, 18944, 3584),
    ("0.5b gate", Format.Q5_0, 4864, 896),
]
TILES = [
    GemmTile(bm, bn, warps, stages)
    for bm, bn, warps, stages in itertools.product((64, 128), (64, 128, 256), (4, 8), (2, 3, 4))
    if bm * bn <= 128 * 256 and not (warps == 4 and bm * bn > 128 * 128)
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--formats", default="", help="comma-separated format names to keep (default: all)")
    args = ap.parse_args()
    keep = {f.strip().upper() for f in args.formats.split(",") if f.strip()}
    rng = np.random.default_rng(0)
    m = args.rows
    for name, fmt, n, k in SHAPES:
        if keep and fmt.name not in keep:
            continue
        w = torch.from_numpy(random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng).reshape(-1)).cuda()
        x = torch.randn(m, k, device="cuda")
        acts = quant.quantize(x, quant.empty_q8(m, k, "cuda"))
        dense = dequantize(w, fmt, n, k, torch.empty((n, k), dtype=torch.float16, device="cuda"))
        want = (quant.dequantize(acts).half() @ dense.T).float()
        flops = 2 * m * n * k
        cublas = timed(lambda: (x.half() @ dense.T).float())  # noqa: B023
        out = torch.empty((m, n), device="cuda")
        results = []
        for t in TILES:
            try:
                took = timed(functools.partial(G.gemm_q8, acts, w, fmt, n, k, out, tile=t))
            except Exception as e:  # a tile that does not compile or fit is reported, not fatal
                results.append((0.0, f"{tuple(t)}: {type(e).__name__}"))
                continue
            err = float((out - want).abs().max() / want.abs().max())
            flag = "" if err < 1e-2 else f" (diff {err:.0e})"
            results.append((flops / took / 1e12, f"{t.block_m}x{t.block_n} w{t.warps} s{t.stages}{flag}"))
        best = max(results)
        print(f"{name:14} {fmt.name:6} {n}x{k}  cuBLAS f16 copy {flops / cublas / 1e12:6.1f} TFLOP/s", flush=True)
        for tflops, label in sorted(results, reverse=True):
            print(f"    {tflops:7.1f}  {label}{'  <- best' if (tflops, label) == best else ''}", flush=True)


if __name__ == "__main__":
    main()
