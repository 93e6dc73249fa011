"""Sweep the decode GEMV's tile (rows a program, warps) on real shapes and print GB/s for each.

Usage: python benchmarks/gemv_sweep.py   (on a GPU)
Each product is timed with CUDA events over repeated launches; the weights are random blocks of the format.
"""

from __future__ import annotations

import numpy as np
import torch

from fuselane.gguf.formats import LAYOUTS, Format, row_bytes
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.triton import gemv as G

SHAPES = [  # (name, format, n, k)
    ("8b q/o", Format.Q4_K, 4096, 4096),
    ("8b gate", Format.Q4_K, 12288, 4096),
    ("8b down", Format.Q6_K, 4096, 12288),
    ("8b head", Format.Q6_K, 151936, 4096),
    ("0.5b gate", Format.Q5_0, 4864, 896),
    ("0.5b q", Format.Q5_0, 896, 896),
    ("0.6b gate", Format.Q8_0, 3072, 1024),
]
TILES = [None, (16, 4), (8, 4), (4, 4), (8, 8), (4, 2), (2, 2), (16, 8), (32, 8), (2, 1), (4, 1)]
REPS = 50


def time_once(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPS / 1e3


def main() -> None:
    rng = np.random.default_rng(0)
    original = G._tile
    for name, fmt, n, k in SHAPES:
        nbytes = n * row_bytes(fmt, k)
        blocks = random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng)
        w = torch.from_numpy(blocks.reshape(-1)).cuda()
        x = torch.randn(1, k, device="cuda")
        out = torch.empty(1, n, device="cuda")
        line = []
        for tile in TILES:
            G._tile = original if tile is None else (lambda *a, t=tile: t)
            try:
                s = time_once(lambda x=x, w=w, fmt=fmt, n=n, k=k, out=out: G.gemv(x, w, fmt, n, k, out))
                line.append(f"{'default' if tile is None else tile}: {nbytes / s / 1e9:6.0f}")
            except Exception as e:  # a tile the kernel refuses for this shape
                line.append(f"{tile}: {type(e).__name__}")
        G._tile = original
        print(f"{name:10} {fmt.name:5} {n}x{k} ({nbytes / 1e6:.1f} MB) GB/s -> " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
