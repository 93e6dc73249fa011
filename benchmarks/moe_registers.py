"""The grouped expert GEMM's kernels (`triton.moe.grouped`) as compiled for an H200 (sm_90a), without a GPU:
each kernel's registers a thread and spills, from ptxas -v (the ptxas Triton ships), at Qwen3-30B-A3B's widths.
With `--decode`, the decode step's mixture launches instead (routing, gate/up, down under int8 activations and
dependent launches, each compiled through its own launcher): each one's grid, warps, registers and stack bytes
(`compile_check.resources`), and with `--sass DIR` its SASS, to read where the loads sit against the dp4a.

Usage: python benchmarks/moe_registers.py [--fmt Q4_K Q6_K ...] [--block-m 32] [--block-n 64] [--warps 8]
       [--stages 2] [--step 128] [--dff 768] [--step-scales]
       python benchmarks/moe_registers.py --decode [--fmt Q4_K Q6_K] [--sass DIR] [--shared 512]

What the tile table (`plan/kernels.py`, `moe_gemm_tile`: MOE_GEMM_* and MOE_WORDS_TILES) says of spills is what
this prints, each format at its own tile unless one is given, with the routing launch's row scales (the lane's
path; `--step-scales`: a step's own, the branch in the k loop) and whether the pipeliner staged the loads
(cp.async in the PTX); a tile that spills moves its values through local memory, which the timing
(`benchmarks/moe_prefill.py`) then shows.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan import moe_kernels

D, DFF, EXPERTS, TOP, ROWS = 2048, 768, 128, 8, 512
SM90 = GPUTarget("cuda", 90, 32)
POINTERS = {"w": "*u8", "w_gate": "*u8", "w_up": "*u8", "order": "*i32", "counts": "*i32", "counters": "*i32",
            "h_amax": "*i32", "x16": "*fp16"}  # fmt: skip


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


def _compile(kernel, consts: dict, warps: int, stages: int) -> str:
    sig = {
        name: "constexpr" if name in consts else "fp32" if name == "eps" else POINTERS.get(name, "*fp32")
        for name in kernel.arg_names
    }
    # every pointer 16-byte aligned, as a launch's JIT specializes a device allocation's
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if sig[name].startswith("*")}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs), target=SM90,
                              options=dict(num_warps=warps, num_stages=stages))  # fmt: skip
    staged = "cp.async" in compiled.asm["ptx"]
    return f"{_ptxas(compiled.asm['ptx'])}; loads {'staged' if staged else 'not staged'}"


def _decode(fmts: list[Format], sass: str | None, variant: str | None = None, sdff: int = 0) -> None:
    """Compile the decode launches at Qwen3-30B-A3B's widths (a fresh process: not under the interpreter); with
    `sdff`, the gate/up and down launches again with a folded shared expert of that width (its SwiGLU in f32
    products, then in the kept experts' int8 tiles: `moe_kernels.MOE_SHARED_INT8`)."""
    import torch
    from triton.runtime.jit import JITFunction

    from fuselane.lanes.cuda.compile_check import Report, compiling, resources
    from fuselane.lanes.cuda.plan.kernels import stored_row_bytes as row_bytes  # the rows as the lane stores them

    seen: list[tuple[str, object, object]] = []
    with compiling(90, Report()):
        from fuselane.lanes.cuda.triton import pdl
        from fuselane.lanes.cuda.triton.moe import down, gate_up, route, shared
        from fuselane.lanes.cuda.triton.quant import empty_q8

        compile_only = JITFunction.run

        def noted(self, *args, grid, warmup, **kwargs):
            kernel = compile_only(self, *args, grid=grid, warmup=warmup, **kwargs)
            folded = "" if not kwargs.get("SHARED") else " +shared int8" if kwargs.get("SHARED_Q8") else " +shared"
            seen.append((f"{self.fn.__name__} {Format(kwargs.get('FMT', 0)).name}{folded}", grid, kernel))
            return kernel

        JITFunction.run = noted
        try:
            with pdl.dependent_launches(True):
                ids, weights = torch.zeros(1, TOP, dtype=torch.int32), torch.zeros(1, TOP)
                wr = torch.zeros(EXPERTS * D * 4, dtype=torch.uint8)  # the router in f32
                route.route(torch.zeros(1, D), wr, Format.F32, EXPERTS, TOP, True, ids, weights,
                            torch.zeros(1, EXPERTS), route.counters("cpu"))  # fmt: skip
                for fmt, folded, q8 in itertools.product(fmts, [False, True] if sdff else [False], [False, True]):
                    if q8 and not folded:
                        continue
                    moe_kernels.MOE_SHARED_INT8 = q8
                    s = _shared(shared, fmt, sdff) if folded else None
                    wg = torch.zeros(EXPERTS * DFF * row_bytes(fmt, D), dtype=torch.uint8)
                    gate_up.gate_up(empty_q8(1, D, "cpu"), wg, wg, fmt, ids, DFF, D, torch.zeros(TOP, DFF),
                                    empty_q8(TOP, DFF, "cpu"), s)  # fmt: skip
                    if q8:
                        continue  # the down launch is the same either way
                    wd = torch.zeros(EXPERTS * D * row_bytes(fmt, DFF), dtype=torch.uint8)
                    norm = down.Norm(torch.zeros(D), 1e-6, torch.zeros(1, D), empty_q8(1, D, "cpu"))
                    h, out = empty_q8(TOP, DFF, "cpu"), torch.zeros(1, D)
                    down.down_combine(h, wd, fmt, ids, weights, D, DFF, out, adds=(torch.zeros(1, D),), norm=norm,
                                      counter=down.counters(1, "cpu"), variant=variant, shared=s)  # fmt: skip
        finally:
            JITFunction.run = compile_only
    for name, grid, kernel in seen:
        regs, stack = resources(kernel.asm["cubin"])
        programs = grid[0] * (grid[1] if len(grid) > 1 else 1)
        warps = kernel.metadata.num_warps
        print(f"{name:24s} grid {str(tuple(grid)):10s} {programs:5d} programs x {warps:2d} warps  {regs:3d} registers"
              f"  {stack:4d} stack bytes")  # fmt: skip
        if sass:
            _write_sass(kernel.asm["cubin"], os.path.join(sass, name.replace(" ", "_") + ".sass"))


def _shared(shared, fmt: Format, sdff: int):
    """A folded shared expert of `sdff` values in `fmt`, its score row in f32, on the host."""
    import torch

    from fuselane.lanes.cuda.plan.kernels import stored_row_bytes as row_bytes  # the rows as the lane stores them

    gate_up_rows = torch.zeros(sdff * row_bytes(fmt, D), dtype=torch.uint8)
    return shared.Shared(torch.zeros(1, D), gate_up_rows, gate_up_rows,
                         torch.zeros(D * row_bytes(fmt, sdff), dtype=torch.uint8),
                         torch.zeros(D * 4, dtype=torch.uint8), fmt, fmt, Format.F32, sdff,
                         torch.zeros(sdff + 1))  # fmt: skip


def _write_sass(cubin: bytes, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    with open(path, "w") as out:
        out.write(subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout)
    os.unlink(f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", nargs="+", default=["Q4_K", "Q6_K"])
    ap.add_argument("--block-m", type=int, default=None)
    ap.add_argument("--block-n", type=int, default=None, help="both kernels' (default: the table's)")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--step", type=int, default=None, help="values a step of the word decode (Q4_K, Q6_K)")
    ap.add_argument("--dff", type=int, default=DFF, help="an expert's ffn width (DeepSeek-V2-Lite's: 1408)")
    ap.add_argument("--step-scales", action="store_true", help="a step's own f16 scale (no routing row scales)")
    ap.add_argument("--decode", action="store_true", help="the decode step's routing, gate/up and down launches")
    ap.add_argument("--sass", default=None, help="with --decode: write each kernel's SASS to this folder")
    ap.add_argument("--variant", default=None, help="with --decode: the down launch's (moe_kernels.MoeDown's value)")
    ap.add_argument("--shared", type=int, default=0, help="with --decode: a folded shared expert's width too")
    a = ap.parse_args()
    if a.decode:
        _decode([Format[f] for f in a.fmt], a.sass, a.variant, a.shared)
        return
    from fuselane.lanes.cuda.triton.moe import grouped as G  # here: --decode compiles in a process of its own

    common = dict(SLOTS=TOP, E=EXPERTS, E_BLOCK=triton.next_power_of_2(EXPERTS), ROW_SCALES=not a.step_scales,
                  PDL=True)  # fmt: skip
    for fmt in (Format[f] for f in a.fmt):
        for down, (n, k) in ((False, (a.dff, D)), (True, (D, a.dff))):
            launch = moe_kernels.MoeLaunch.DOWN if down else moe_kernels.MoeLaunch.GATE_UP
            bm, bn, warps, stages, step = G.tile_options(fmt, launch, a.block_m, a.block_n, a.warps, a.stages, a.step)
            consts = dict(**G.format_consts(fmt, n, k, word_step=step, launch=launch), BLOCK_M=bm, BLOCK_N=bn,
                          **common)  # fmt: skip
            if down:
                consts.update(D=D, DFF=a.dff, ADDS=1, NORM=True, NORM_CHUNK=moe_kernels.MOE_NORM_CHUNK, ROWS=ROWS)
            else:
                consts.update(N=a.dff, KD=D)
            said = _compile(G.down_kernel if down else G.gate_up_kernel, consts, warps, stages)
            name = "down" if down else "gate/up"
            print(f"{name:7s} {fmt.name:5s} {bm} x {bn}, {warps} warps, {stages} stages, "
                  f"{consts['STEP_VALUES']} values a step: {said}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
