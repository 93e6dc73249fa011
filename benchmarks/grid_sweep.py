"""Time the grid GEMV (`grid.gemv.gemv_grid`) on a 7B's widths under tiles of (weight rows a program, warps,
values a k step, and on int8 rows a thread's run of groups of one 32-value sub-block), in GB/s of the file's
bytes, each launch replayed from a CUDA graph.

Usage: python benchmarks/grid_sweep.py   (on a GPU; SWEEP_QUICK=1 for the 7B's widths and three tiles; SWEEP_INT8=1
for the activation's int8 form, `grid/q8.py`'s dp4a dot; SWEEP_ALL_TILES=1 every tile at the quick shapes)
The module's own tile's result is compared with the f64 product of the dequantized matrix (on the f32 row: under
SWEEP_INT8 the error is the activation's quantization's), each other tile's with it; a tile that does not compile
is reported.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from gemv_compare import timed

from fuselane.gguf.dequant import dequantize
from fuselane.gguf.formats import LAYOUTS, Format, row_bytes
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.run.stored import stored_bytes
from fuselane.lanes.cuda.triton.grid import gemv as G
from fuselane.lanes.cuda.triton.quant import empty_q8, quantize

SHAPES = [  # (name, format, n, k)
    ("7b gate", Format.IQ3_S, 18944, 3584),
    ("7b down", Format.IQ3_S, 3584, 18944),
    ("7b o", Format.IQ3_S, 3584, 3584),
    ("0.5b gate", Format.IQ3_S, 4864, 896),
    ("0.5b down", Format.IQ3_S, 896, 4864),
    ("32b gate", Format.IQ3_S, 27648, 5120),
    ("32b down", Format.IQ3_S, 5120, 27648),
    ("7b gate", Format.IQ2_XXS, 18944, 3584),
    ("7b down", Format.IQ2_XXS, 3584, 18944),
]
# (rows, warps, values a step[, a thread's run of groups on int8 rows]): past 256, whole super-blocks a step
# (`grid/steps.py`)
TILES = [(16, 4, 128), (8, 2, 128), (4, 1, 128), (8, 2, 256), (8, 4, 256), (16, 8, 256), (4, 2, 256), (2, 4, 512),
         (1, 4, 1024), (4, 4, 512), (2, 2, 512), (4, 8, 1024), (2, 1, 512, 4), (8, 2, 1024, 4), (4, 4, 1024, 4),
         (2, 4, 2048, 4), (8, 2, 128, 2)]  # fmt: skip
# SWEEP_QUICK=1: the 7B's three widths, the rule's tiles against the first tile and the wide steps
QUICK_SHAPES = SHAPES[:3]
QUICK_TILES = [(16, 4, 128), (8, 2, 128), (16, 8, 256), (4, 2, 256), (2, 4, 512), (1, 4, 1024), (4, 4, 512),
               (2, 1, 512, 4), (4, 4, 1024, 4), (2, 4, 2048, 4), (8, 2, 128, 2)]  # fmt: skip


def with_tile(tile: tuple, call):
    """`call()` under the tile (`GridTile`'s fields) for every launch, the module's own rule put back after."""
    own = G.grid_tile
    G.grid_tile = lambda n, m=1: G.GridTile(*tile)
    try:
        return call()
    finally:
        G.grid_tile = own


def main() -> None:
    rng = np.random.default_rng(0)
    quick = os.environ.get("SWEEP_QUICK") == "1"
    int8 = os.environ.get("SWEEP_INT8") == "1"
    all_tiles = os.environ.get("SWEEP_ALL_TILES") == "1"
    for name, fmt, n, k in QUICK_SHAPES if quick else SHAPES:
        raw = random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng)
        w = torch.from_numpy(stored_bytes(fmt, raw, row_bytes(fmt, k))).cuda()
        x = torch.randn(1, k, device="cuda")
        xin = quantize(x, empty_q8(1, k, "cuda")) if int8 else x
        want, out = torch.empty(1, n, device="cuda"), torch.empty(1, n, device="cuda")
        G.gemv_grid(xin, w, fmt, n, k, want)
        ref = dequantize(raw.reshape(-1), fmt, (n, k), dtype=np.float64) @ x.double().cpu().numpy()[0]
        err = float(np.abs(want.double().cpu().numpy()[0] - ref).max() / np.abs(ref).max())
        nbytes = n * stored_row_bytes(fmt, k)
        row = []
        for tile in QUICK_TILES if quick and not all_tiles else TILES:
            label = "/".join(map(str, tile))
            try:
                took = with_tile(tile, lambda: timed(lambda: G.gemv_grid(xin, w, fmt, n, k, out)))  # noqa: B023
            except Exception as e:  # reported, not fatal
                row.append(f"{label}: {type(e).__name__}")
                continue
            diff = float((out - want).abs().max() / want.abs().max())
            note = "" if diff < 1e-4 else f" (diff {diff:.0e})"
            row.append(f"{label}: {nbytes / took / 1e9:5.0f}{note}")
        print(f"{name} {fmt.name} {n}x{k} {nbytes / 1e6:.1f} MB (vs f64 {err:.0e})  " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
