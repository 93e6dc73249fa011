"""Time the int8 prefill GEMM (`gemm_q8`) over candidate tiles against cuBLAS on an f16 copy, on a 512-row chunk.

For each product of the reference shapes (Qwen2.5-7B, Qwen3-8B, the small ones) and each tile of
`gemm_tiles.SWEEP` (BLOCK_M activation rows, BLOCK_N weight rows, warps, stages: 54 candidates), prints
TFLOP/s (2 m n k a launch, replayed from a CUDA graph), microseconds, and the largest difference from the
f16-copy product relative to its largest value; the row's best tile is marked. Write the best ones into
`fuselane/lanes/cuda/plan/gemm_tiles.py` (`TILES`, `DEFAULT_TILE`).

Every (shape, tile) is a kernel of its own to compile (the format, k and tile are constants of it), several
hundred in all: they are compiled first by `--jobs` processes at once, each launching its kernels once on
zeros, and the timing then finds them in Triton's cache. `benchmarks/gemm_q8_registers.py` tells a tile's
registers and spills without a GPU.

Usage: python benchmarks/gemm_q8_sweep.py [--rows 512] [--formats Q4_K,Q6_K] [--shapes "7b gate,7b down"]
       [--tiles 64x128w4s3,32x128w4s3] [--jobs 12]   (on a GPU)
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from benchmarks.gemv_compare import timed
from fuselane.gguf.formats import LAYOUTS, Format, row_bytes
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.plan import gemm_tiles
from fuselane.lanes.cuda.plan.gemm_tiles import GemmTile
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.run.stored import stored_bytes
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
CLOSE = 1e-2  # a difference from the f16-copy product past this (relative to its largest value) is flagged


def _tile(text: str) -> GemmTile:
    """'64x128w4s3' as a tile."""
    size, rest = text.split("w")
    warps, stages = rest.split("s")
    bm, bn = size.split("x")
    return GemmTile(int(bm), int(bn), int(warps), int(stages))


def _label(t: GemmTile) -> str:
    return f"{t.block_m}x{t.block_n}w{t.warps}s{t.stages}"


def _compile(job: tuple[Format, int, int, int, GemmTile]) -> str:
    """Launch one (shape, tile) once on zeros (in a worker process), so its kernel lands in Triton's cache."""
    fmt, m, n, k, t = job
    try:
        w = torch.zeros(n * stored_row_bytes(fmt, k), dtype=torch.uint8, device="cuda")
        acts = quant.quantize(torch.zeros(m, k, device="cuda"), quant.empty_q8(m, k, "cuda"))
        G.gemm_q8(acts, w, fmt, n, k, torch.empty((m, n), device="cuda"), tile=t)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # a tile that does not compile is reported by the timing too
        return f"{fmt.name} {_label(t)}: {type(e).__name__}: {str(e)[:200]}"


def _precompile(jobs: list, workers: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for said in pool.map(_compile, jobs):
            if said:
                print(f"    compile: {said}", flush=True)


def _sweep(name: str, fmt: Format, m: int, n: int, k: int, tiles: list[GemmTile], rng) -> None:
    raw = random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng)
    w = torch.from_numpy(stored_bytes(fmt, raw, row_bytes(fmt, k))).cuda()  # as the lane stores the rows
    x = torch.randn(m, k, device="cuda")
    acts = quant.quantize(x, quant.empty_q8(m, k, "cuda"))
    dense = dequantize(w, fmt, n, k, torch.empty((n, k), dtype=torch.float16, device="cuda"))
    want = (quant.dequantize(acts).half() @ dense.T).float()
    flops = 2 * m * n * k
    cublas = timed(lambda: (x.half() @ dense.T).float())
    out = torch.empty((m, n), device="cuda")
    results = []
    for t in tiles:
        try:
            took = timed(functools.partial(G.gemm_q8, acts, w, fmt, n, k, out, tile=t))
        except Exception as e:  # a tile that does not compile or fit is reported, not fatal
            results.append((0.0, 0.0, f"{_label(t)}: {type(e).__name__}"))
            continue
        err = float((out - want).abs().max() / want.abs().max())
        flag = "" if err < CLOSE else f" (diff {err:.0e})"
        results.append((flops / took / 1e12, took * 1e6, f"{_label(t)}{flag}"))
    best = max(results)
    print(f"{name:14} {fmt.name:6} {m}x{n}x{k}  cuBLAS f16 copy {flops / cublas / 1e12:6.1f} TFLOP/s "
          f"{cublas * 1e6:8.1f} us", flush=True)  # fmt: skip
    for row in sorted(results, reverse=True):
        tflops, us, label = row
        print(f"    {tflops:7.1f} TFLOP/s {us:9.1f} us  {label}{'  <- best' if row == best else ''}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--formats", default="", help="comma-separated format names to keep (default: all)")
    ap.add_argument("--shapes", default="", help="comma-separated shape names to keep (default: all)")
    ap.add_argument("--tiles", default="", help="comma-separated tiles as 64x128w4s3 (default: gemm_tiles.SWEEP)")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compiling processes")
    args = ap.parse_args()
    keep = {f.strip().upper() for f in args.formats.split(",") if f.strip()}
    names = {s.strip() for s in args.shapes.split(",") if s.strip()}
    tiles = [_tile(t.strip()) for t in args.tiles.split(",") if t.strip()] or list(gemm_tiles.SWEEP)
    shapes = [s for s in SHAPES if (not keep or s[1].name in keep) and (not names or s[0] in names)]
    m = args.rows
    _precompile([(fmt, m, n, k, t) for _, fmt, n, k in shapes for t in tiles], args.jobs)
    rng = np.random.default_rng(0)
    for name, fmt, n, k in shapes:
        _sweep(name, fmt, m, n, k, tiles, rng)


if __name__ == "__main__":
    main()
