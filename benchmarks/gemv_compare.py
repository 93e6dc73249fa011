"""Time the decode GEMVs on real shapes: the in-parts kernel (`gemv`) against the tile-streaming one
(`gemv_fast`), in GB/s of weights read, each launch replayed from a CUDA graph so no host time counts.

Usage: python benchmarks/gemv_compare.py [--tiles]   (on a GPU)
--tiles sweeps the tile-streaming kernels' tiles (rows a program, warps, (row, group)s a thread) instead.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

from fuselane.gguf.formats import LAYOUTS, Format, row_bytes
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.triton import gemv as G
from fuselane.lanes.cuda.triton import gemv_fast as F

SHAPES = [  # (name, format, n, k)
    ("8b q/o", Format.Q4_K, 4096, 4096),
    ("8b gate", Format.Q4_K, 12288, 4096),
    ("8b down", Format.Q6_K, 4096, 12288),
    ("8b head", Format.Q6_K, 151936, 4096),
    ("7b gate", Format.Q4_K, 18944, 3584),
    ("0.5b gate", Format.Q5_0, 4864, 896),
    ("0.5b head", Format.Q8_0, 151936, 896),
    ("0.6b gate", Format.Q8_0, 3072, 1024),
]
REPS = 20


def timed(fn) -> float:
    """Seconds a launch takes, replayed REPS times from one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPS / 1e3


def cases():
    """Each shape of SHAPES with random weights in its format on the device, a random row and two outputs."""
    rng = np.random.default_rng(0)
    for name, fmt, n, k in SHAPES:
        w = torch.from_numpy(random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng).reshape(-1)).cuda()
        outs = torch.empty(1, n, device="cuda"), torch.empty(1, n, device="cuda")
        yield name, fmt, n, k, n * row_bytes(fmt, k), w, torch.randn(1, k, device="cuda"), outs


def main() -> None:
    for name, fmt, n, k, nbytes, w, x, (a, b) in cases():
        slow = timed(lambda: G.gemv(x, w, fmt, n, k, a))  # noqa: B023
        fast = timed(lambda: F.gemv_fast(x, w, fmt, n, k, b))  # noqa: B023
        err = float((a - b).abs().max() / a.abs().max())
        print(
            f"{name:10} {fmt.name:5} {n}x{k} {nbytes / 1e6:7.1f} MB: gemv {nbytes / slow / 1e9:6.0f} GB/s "
            f"({slow * 1e6:7.1f} us), gemv_fast {nbytes / fast / 1e9:6.0f} GB/s ({fast * 1e6:7.1f} us), "
            f"rel diff {err:.1e}",
            flush=True,
        )


TILES = [(8, 4, 1), (4, 4, 2), (4, 4, 4), (2, 4, 2), (2, 4, 4), (4, 8, 2), (4, 2, 2), (4, 8, 1)]


def _sweep(call, nbytes: int, check=None) -> str:
    """GB/s of `call(block_n=, warps=, per_thread=)` under each tile of TILES (and its difference from the
    default tile's result where `check` returns it)."""
    row = []
    for bn, warps, pt in TILES:
        launch = functools.partial(call, block_n=bn, warps=warps, per_thread=pt)
        try:
            took = timed(launch)
        except Exception as e:  # a tile that does not compile or fit is reported, not fatal
            row.append(f"{bn}/{warps}/{pt}: {type(e).__name__}")
            continue
        err = check() if check else 0.0
        row.append(f"{bn}/{warps}/{pt}: {nbytes / took / 1e9:5.0f}" + ("" if err < 1e-5 else f" (diff {err:.0e})"))
    return "  ".join(row)


def tiles() -> None:
    """GB/s of the tile-streaming GEMV and gate/up GLU under each (block_n, warps, per_thread) of TILES."""
    for name, fmt, n, k, nbytes, w, x, (want, out) in cases():
        F.gemv_fast(x, w, fmt, n, k, want)
        diff = functools.partial(lambda o, t: float((o - t).abs().max() / t.abs().max()), out, want)
        print(
            f"{name:10} {fmt.name:5} gemv  "
            + _sweep(functools.partial(F.gemv_fast, x, w, fmt, n, k, out), nbytes, diff),
            flush=True,
        )
        if "gate" in name:
            glu = functools.partial(F.gemv_fast_gate_up_glu, x, w, w, fmt, n, k, out)
            print(f"{name:10} {fmt.name:5} glu   " + _sweep(glu, 2 * nbytes), flush=True)


if __name__ == "__main__":
    tiles() if "--tiles" in sys.argv else main()
