"""The whole-matrix decode's tile by format, on a GPU: each format's (n, k) matrix decoded to f16 (the
`prefill=f16-scratch` operand) at each (values a program, warps), its bytes read and written a second.

Usage: python benchmarks/dequant_sweep.py [--n 18944] [--k 3584] [--formats Q4_K Q6_K ...]
Four copies of the matrix are decoded in turn, so each launch reads its bytes from memory, as a prefill chunk
does; the figure is the launch's checkpoint bytes plus its f16 values over its time. `kernels.DEQUANT_TILES`
takes the best tile of each format where it beats `kernels.DEQUANT_TILE` by more than the noise.
"""

from __future__ import annotations

import argparse

import torch
from gemv_compare import timed_in_turn

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize

TILES = ((2048, 8), (4096, 4), (8192, 4), (8192, 8), (16384, 4), (16384, 8))
COPIES, REPS = 4, 40


def sweep(fmt: Format, n: int, k: int) -> None:
    size = n * stored_row_bytes(fmt, k)  # as the lane stores the rows
    ws = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda") for _ in range(COPIES)]
    outs = [torch.empty((n, k), dtype=torch.float16, device="cuda") for _ in range(COPIES)]
    moved = size + 2 * n * k
    figures = []
    for tile in TILES:
        calls = [
            lambda w=w, o=o, t=tile: dequantize(w, fmt, n, k, o, values_warps=t) for w, o in zip(ws, outs, strict=True)
        ]
        seconds = timed_in_turn(calls, REPS)
        figures.append(f"{tile[0]}/{tile[1]} {seconds * 1e6:7.1f} us {moved / seconds / 1e12:4.2f} TB/s")
    chosen = kernels.dequant_tile(fmt)
    print(f"{fmt.name:7} ({n} x {k}, plan {chosen[0]}/{chosen[1]}): " + " | ".join(figures), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=18944)
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--formats", nargs="+", default=[f.name for f in sorted(kernels.DEQUANT_FORMATS)])
    args = ap.parse_args()
    for name in args.formats:
        sweep(Format[name], args.n, args.k)


if __name__ == "__main__":
    main()
