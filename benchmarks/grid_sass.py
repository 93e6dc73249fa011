"""The grid GEMV (`triton/grid/gemv.py`) and the whole-matrix decode (`triton/grid/decode.py`) as compiled for an
H200 (sm_90), without a GPU: registers and stack bytes a thread, and their SASS counted: all instructions, global
loads (LDG), and for the GEMV its k loop's body (from the target of its backward branch to the branch) over the
weight values a thread decodes a step of it (instructions a value), for the decode (no loop) the whole kernel
over the values a thread decodes.

Why: a grid value costs its fields' loads, a table gather and the bit work that finds them; the counts weigh a
change to the decode before a GPU times it. (Timed on an H100, the GEMV waits on its loads more than on issue: a
cut from 13.6 to 12.4 instructions a value gained 2-4 %; benchmarks/RESULTS.md, 2026-12-07 seventh.)

Run it in a process of its own, without `TRITON_INTERPRET`.

Usage: python benchmarks/grid_sass.py [--formats IQ2_XXS,IQ3_S] [--n 3584] [--k 18944] [--m 1] [--int8]
(--int8: the GEMV on a step's row in int8, `grid/q8.py`; the ternary formats keep f32)
"""

from __future__ import annotations

import argparse
import re

import torch
from gemv_sass import ARCH, counts, noting

from fuselane.gguf.formats import GRID_FORMATS, LAYOUTS, QK_K, Format
from fuselane.lanes.cuda.compile_check import Report, compiling, cuobjdump, resources
from fuselane.lanes.cuda.plan.kernels import WARP

_BACK = re.compile(r"@!?P\d+\s+BRA\s+(0x[0-9a-f]+)")
_AT = re.compile(r"/\*([0-9a-f]{4,})\*/\s+\S")


def loop_lines(sass: str) -> list[str]:
    """The first backward branch's loop: its instructions from its target's address to the branch."""
    lines = [line for line in sass.splitlines() if _AT.search(line)]
    for i, line in enumerate(lines):
        back = _BACK.search(line)
        here = int(_AT.search(line).group(1), 16)
        if back and int(back.group(1), 16) < here:
            start = int(back.group(1), 16)
            return [other for other in lines[: i + 1] if int(_AT.search(other).group(1), 16) >= start]
    return []


def loop_body(sass: str) -> int:
    """Instructions of the first backward branch's loop."""
    return len(loop_lines(sass))


def unrolled(sass: str, fmt: Format, int8: bool, groups: int) -> int:
    """How many steps of the k loop ptxas put in one trip of the loop (Triton's `tl.range` may unroll it), a
    step's `groups` of 8 values a thread: on int8 rows, the loop's dp4a over a step's (two a group; four for
    IQ1's offset); 1 where not known."""
    if not int8:
        return 1
    per_group = 4 if fmt in (Format.IQ1_S, Format.IQ1_M) else 2
    dp4a = sum(1 for line in loop_lines(sass) if "IDP.4A" in line)
    return max(1, dp4a // (per_group * groups))


def compiled(formats: list[Format], n: int, k: int, m: int, int8: bool = False) -> list[tuple[str, Format, bytes]]:
    """(kernel, format, cubin) of each format's grid GEMV over n x k at m rows (one row in int8 where `int8`) and
    its whole-matrix decode."""
    seen: list[tuple[str, Format, bytes]] = []
    with compiling(ARCH, Report()):
        from fuselane.lanes.cuda.triton import pdl
        from fuselane.lanes.cuda.triton.grid import gemv as grid_gemv
        from fuselane.lanes.cuda.triton.grid.decode import dequantize_grid
        from fuselane.lanes.cuda.triton.grid.q8 import Q8_FORMATS
        from fuselane.lanes.cuda.triton.quant import Q8Acts

        with noting(seen), pdl.dependent_launches(True):
            for fmt in formats:
                lay = LAYOUTS[fmt]
                w = torch.zeros(n * (k // lay.values) * lay.nbytes, dtype=torch.uint8)
                x = torch.zeros(m, k)
                if int8 and fmt in Q8_FORMATS:
                    x = Q8Acts(torch.zeros(1, k, dtype=torch.int8), torch.zeros(1, k // 32), torch.zeros(1, k // 16))
                grid_gemv.gemv_grid(x, w, fmt, n, k, torch.zeros(1 if int8 else m, n))
                dequantize_grid(w, fmt, n, k, torch.zeros(n, k, dtype=torch.float16))
    return seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(sorted(f.name for f in GRID_FORMATS)), help="comma-separated")
    ap.add_argument("--n", type=int, default=3584, help="the product's rows")
    ap.add_argument("--k", type=int, default=18944, help="its width (whole 256-value super-blocks)")
    ap.add_argument("--m", type=int, default=1, help="rows of x")
    ap.add_argument("--int8", action="store_true", help="a step's row in int8 (`grid/q8.py`)")
    args = ap.parse_args()
    formats = [Format[f] for f in args.formats.split(",")]
    cubins = compiled(formats, args.n, args.k, args.m, args.int8)
    from fuselane.lanes.cuda.triton.grid.decode import DECODE_WARPS, PROGRAM_BLOCKS
    from fuselane.lanes.cuda.triton.grid.gemv import grid_tile
    from fuselane.lanes.cuda.triton.grid.values import GRID_GROUP

    tile = grid_tile(args.n, 1 if args.int8 else args.m)
    # a step's values a thread; the GEMV's loop may hold several steps (`unrolled`), whose values it counts
    per_thread = {"_grid_gemv_kernel": tile.values_a_thread()}
    per_thread["_grid_dequant_kernel"] = PROGRAM_BLOCKS * QK_K // (DECODE_WARPS * WARP)
    print(f"tile: {tile.block_n} rows, {tile.warps} warps, {tile.slice} values a step")
    head = f"{'kernel':22} {'fmt':8} {'regs':>4} {'stack':>5} {'instr':>6} {'LDG':>5} {'loop':>5} {'steps':>5}"
    print(f"{head} {'a value':>7}")
    for name, fmt, cubin in cubins:
        c = counts(cubin)
        regs, stack = resources(cubin)
        total, loads = sum(c.values()), sum(v for op, v in c.items() if op.startswith("LDG"))
        sass = cuobjdump(cubin, "-sass")
        body = loop_body(sass) or total
        trip = unrolled(sass, fmt, args.int8, per_thread[name] // GRID_GROUP) if name == "_grid_gemv_kernel" else 1
        row = f"{name:22} {fmt.name:8} {regs:4d} {stack:5d} {total:6d} {loads:5d} {body:5d} {trip:5d}"
        print(f"{row} {body / (trip * per_thread[name]):7.1f}")


if __name__ == "__main__":
    main()
