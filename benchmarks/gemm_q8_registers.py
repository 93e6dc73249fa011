"""The int8 prefill GEMM's kernel (`triton.gemm_q8`) as compiled for an H200 (sm_90a), without a GPU: registers a
thread and stack bytes (spills) of each format at its tile of `plan.gemm_tiles`, or at the tiles asked.

The kernel is compiled as a launch specializes it (16-aligned pointers, m, n and the pitches multiples of 16:
without that Triton cannot prove a run's 32 bytes contiguous and aligned, loads them a byte a thread and
leaves them out of the pipeline), and the figures are read from the cubin Triton makes (`cuobjdump
--dump-resource-usage`: REG, and STACK, the bytes a thread spills; Triton's `n_spills` is STACK / 4). They
matched the GPU's for the kernel before this one (128 x 128 at 8 warps: 686 spills, 64 x 128 at 4: 6).

Usage: python benchmarks/gemm_q8_registers.py [--formats Q4_K,Q6_K] [--k 3584] [--tiles 64x128w4s3,...]
"""

from __future__ import annotations

import argparse

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.gemm_q8_sweep import _label, _tile
from fuselane.gguf.formats import QK, Format
from fuselane.lanes.cuda.compile_check import resources
from fuselane.lanes.cuda.plan import gemm_tiles
from fuselane.lanes.cuda.plan.gemm_tiles import GemmTile
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes, stored_span_bytes
from fuselane.lanes.cuda.triton import gemm_q8 as G

SM90 = GPUTarget("cuda", 90, 32)
ARGS = {  # the kernel's runtime arguments and their types (f32 output, no bias or residual)
    **dict(xq="*i8", xd="*fp32", xs="*fp32", w="*u8", lut="*i8", out="*fp32", bias="*fp32", res="*fp32"),
    **dict(pos="*i32", m="i32", n="i32", out_pitch="i32", res_pitch="i32"),
}
ALIGNED = [["tt.divisibility", 16]]  # what the JIT's specialization says of an aligned pointer or int


def _consts(fmt: Format, k: int, t: GemmTile) -> dict:
    values = gemm_tiles.block_values(fmt)
    return dict(
        FMT=int(fmt), K=k, ROW_BYTES=stored_row_bytes(fmt, k), BLOCK_BYTES=stored_span_bytes(fmt, values),
        RUNS=values // QK,
        SPLIT=fmt in gemm_tiles.SPLIT_FORMATS, HAS_MIN=fmt in gemm_tiles.MIN_FORMATS,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.stages,
        HAS_BIAS=False, HAS_RES=False, AT_ROW=False, PDL=True,
    )  # fmt: skip


def usage(fmt: Format, k: int, t: GemmTile) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread) of the kernel for `fmt`, rows of `k`, tile `t`, on sm_90a."""
    return kernel_usage(G._gemm_q8_kernel, ARGS, _consts(fmt, k, t), t)


def kernel_usage(kernel, args: dict[str, str], consts: dict, t: GemmTile, unaligned: tuple[str, ...] = ()):
    """(registers, stack bytes) a thread of `kernel` compiled for sm_90a as a launch specializes it: `args` the
    runtime arguments' types, `consts` its constexprs, every runtime argument 16-aligned but `unaligned`."""
    sig = {a: "constexpr" if a in consts else args[a] for a in kernel.arg_names}
    attrs = {(i,): ALIGNED for i, a in enumerate(kernel.arg_names) if a not in consts and a not in unaligned}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    done = triton.compile(src, target=SM90, options=dict(num_warps=t.warps, num_stages=t.stages))
    return resources(done.asm["cubin"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(sorted(f.name for f in gemm_tiles.INT8_GEMM_FORMATS)))
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--tiles", default="", help="comma-separated tiles as 64x128w4s3 (default: each format's)")
    a = ap.parse_args()
    tiles = [_tile(t.strip()) for t in a.tiles.split(",") if t.strip()]
    for fmt in (Format[f.strip().upper()] for f in a.formats.split(",") if f.strip()):
        for t in tiles or [gemm_tiles.tile(fmt)]:
            regs, stack = usage(fmt, a.k, t)
            print(f"{fmt.name:6s} k {a.k}  {_label(t):12s} {regs:3d} registers  {stack:5d} stack bytes", flush=True)


if __name__ == "__main__":
    main()
