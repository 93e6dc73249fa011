"""The super-block prefill GEMM's kernel (`triton.gemm_sb`, Q4_K and Q6_K) as compiled for an H200 (sm_90a),
without a GPU: registers a thread and stack bytes (spills) at each tile asked, as a launch specializes it
(16-aligned pointers and pitches), read from the cubin with the `cuobjdump` Triton ships.

Usage: python benchmarks/gemm_sb_registers.py [--formats Q4_K,Q6_K] [--k 3584] [--tiles 128x64w8s2,...]
"""

from __future__ import annotations

import argparse

from benchmarks.gemm_q8_registers import kernel_usage
from benchmarks.gemm_q8_sweep import _label, _tile
from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan.gemm_tiles import GemmTile
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes, stored_span_bytes
from fuselane.lanes.cuda.triton import gemm_sb as G

ARGS = {  # the kernel's runtime arguments and their types (f32 output, no bias or residual)
    **dict(x="*fp16", scales="*fp32", sums="*fp16", w="*u8", out="*fp32", bias="*fp32", res="*fp32", pos="*i32"),
    **dict(m="i32", n="i32", x_pitch="i32", sums_pitch="i32", out_pitch="i32", res_pitch="i32"),
}
DEFAULT = GemmTile(G.BLOCK_M, G.BLOCK_N, G.WARPS, G.STAGES)


def usage(fmt: Format, k: int, t: GemmTile) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread) of the kernel for `fmt`, rows of `k`, tile `t`, on sm_90a."""
    consts = dict(
        FMT=int(fmt), SB_BYTES=stored_span_bytes(fmt, G.SUPER), ROW_BYTES=stored_row_bytes(fmt, k), STEPS=k // G.SUPER,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.stages, HAS_BIAS=False, HAS_RES=False, AT_ROW=False, PDL=True,
    )  # fmt: skip
    return kernel_usage(G._gemm_sb_kernel, ARGS, consts, t, unaligned=("m",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q4_K,Q6_K")
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--tiles", default="", help="comma-separated tiles as 128x64w8s2 (default: the module's)")
    a = ap.parse_args()
    tiles = [_tile(t.strip()) for t in a.tiles.split(",") if t.strip()] or [DEFAULT]
    for fmt in (Format[f.strip().upper()] for f in a.formats.split(",") if f.strip()):
        for t in tiles:
            regs, stack = usage(fmt, a.k, t)
            print(f"{fmt.name:6s} k {a.k}  {_label(t):12s} {regs:3d} registers  {stack:5d} stack bytes", flush=True)


if __name__ == "__main__":
    main()
