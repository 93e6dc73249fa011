"""The grouped expert GEMM's kernels (`triton.moe.grouped`) as compiled for an H200 (sm_90a), without a GPU:
each kernel's registers a thread and spills, from ptxas -v (the ptxas Triton ships), at Qwen3-30B-A3B's widths.

Usage: python benchmarks/moe_registers.py [--fmt Q4_K Q6_K ...] [--block-m 32] [--block-n 64] [--warps 8]

What the tile table (`plan/kernels.py`, MOE_GEMM_*) says of spills is what this prints; a tile that spills
moves its values through local memory each step, which the timing (`benchmarks/moe_prefill.py`) then shows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton.moe import grouped as G

D, DFF, EXPERTS, TOP, ROWS = 2048, 768, 128, 8, 512
SM90 = GPUTarget("cuda", 90, 32)
POINTERS = {"w": "*u8", "w_gate": "*u8", "w_up": "*u8", "order": "*i32", "counts": "*i32", "counters": "*i32"}


def _ptxas(ptx: str) -> str:
    """ptxas -v's lines on registers and spills for `ptx`."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    args = [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull]
    done = subprocess.run(args, capture_output=True, text=True)
    os.unlink(f.name)
    said = [line.split(":", 1)[-1].strip() for line in done.stderr.splitlines()]
    return " ".join(line for line in said if "spill" in line or "registers" in line)


def _compile(kernel, consts: dict, warps: int) -> str:
    sig = {
        name: "constexpr" if name in consts else "fp32" if name == "eps" else POINTERS.get(name, "*fp32")
        for name in kernel.arg_names
    }
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=SM90,
                              options=dict(num_warps=warps, num_stages=kernels.MOE_GEMM_STAGES))  # fmt: skip
    return _ptxas(compiled.asm["ptx"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", nargs="+", default=["Q4_K", "Q6_K"])
    ap.add_argument("--block-m", type=int, default=kernels.MOE_GEMM_BLOCK_M)
    ap.add_argument("--block-n", type=int, default=None, help="both kernels' (default: the table's)")
    ap.add_argument("--warps", type=int, default=kernels.MOE_GEMM_WARPS)
    a = ap.parse_args()
    common = dict(SLOTS=TOP, E=EXPERTS, E_BLOCK=triton.next_power_of_2(EXPERTS), BLOCK_M=a.block_m, PDL=True)
    for fmt in (Format[f] for f in a.fmt):
        bn = a.block_n or kernels.MOE_GATE_UP_BLOCK_N
        consts = dict(N=DFF, KD=D, **G.format_consts(fmt, DFF, D), BLOCK_N=bn, **common)
        said = _compile(G.gate_up_kernel, consts, a.warps)
        print(f"gate/up {fmt.name:5s} {a.block_m} x {bn}, {a.warps} warps: {said}")
        bn = a.block_n or kernels.MOE_DOWN_BLOCK_N
        consts = dict(D=D, DFF=DFF, **G.format_consts(fmt, D, DFF), ADDS=1, NORM=True,
                      NORM_CHUNK=kernels.MOE_NORM_CHUNK, ROWS=ROWS, BLOCK_N=bn, **common)  # fmt: skip
        said = _compile(G.down_kernel, consts, a.warps)
        print(f"down    {fmt.name:5s} {a.block_m} x {bn}, {a.warps} warps: {said}")


if __name__ == "__main__":
    main()
