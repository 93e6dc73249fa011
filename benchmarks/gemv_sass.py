"""The int8 decode GEMV's launches (a gated pair's GLU with its quantized output, `q8_epilogue`, as a decode step
launches it, and a matrix alone, `q8.gemv_q8`) as compiled for an H200 (sm_90), without a GPU: registers and
stack bytes a thread, and the SASS's instructions counted: all of them, global loads (LDG), dp4a (IDP), and the
shifts, logic ops and byte permutes a format's codes cost.

Why: a format's GEMV that reads its bytes slower than Q4_K's (RESULTS.md 2026-12-03: Q3_K's GLU at 1.6 TB/s,
Q4_K's at 2.9) can be weighed before a GPU runs it: its loads and instructions a dp4a word against Q4_K's
(the Q3_K / Q2_K / IQ4 bodies' rework was planned from these counts, and its gains followed them).

The launches are compiled through their own launchers at the widths asked (`compile_check.compiling`: the
same arguments, specializations and tiles as a decode step's), so a tile table's entry for those widths is
what is counted. Run it in a process of its own, without `TRITON_INTERPRET`.

Usage: python benchmarks/gemv_sass.py [--formats Q3_K,Q2_K,Q4_K] [--n 18944] [--k 3584]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
from collections.abc import Iterator

import torch
from triton.runtime.jit import JITFunction

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.compile_check import Report, compiling, cuobjdump, resources
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.plan.knobs import WeightLoads

ARCH = 90
# an instruction of the SASS: its address comment, an optional predicate, then its name
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
SHOWN = ("SHF", "LOP3", "PRMT", "I2FP", "FFMA")


def counts(cubin: bytes) -> collections.Counter:
    """Each instruction's count in a kernel's SASS, by its name before the first dot."""
    sass = cuobjdump(cubin, "-sass")
    return collections.Counter(m.group(1).split(".")[0] for m in _INSTRUCTION.finditer(sass))


@contextlib.contextmanager
def noting(seen: list[tuple[str, Format, bytes]]) -> Iterator[None]:
    """Within it, every kernel launch (compiled, under `compiling`) notes (kernel, its FMT, its cubin) in `seen`."""
    launch = JITFunction.run

    def noted(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=warmup, **kwargs)
        seen.append((self.fn.__name__, Format(kwargs["FMT"]), kernel.asm["cubin"]))
        return kernel

    JITFunction.run = noted
    try:
        yield
    finally:
        JITFunction.run = launch


def compiled(formats: list[Format], n: int, k: int) -> list[tuple[str, Format, bytes]]:
    """(kernel, format, cubin) of each format's GLU over n x k and its down product over k x n."""
    seen: list[tuple[str, Format, bytes]] = []
    with compiling(ARCH, Report()):
        from fuselane.lanes.cuda.triton import pdl
        from fuselane.lanes.cuda.triton.gemv import q8, q8_epilogue
        from fuselane.lanes.cuda.triton.gemv.weight_loads import weight_loads
        from fuselane.lanes.cuda.triton.quant import empty_q8

        with noting(seen):
            with pdl.dependent_launches(True), weight_loads(WeightLoads.AS_WRITTEN):
                for fmt in formats:
                    pair = torch.zeros(n * stored_row_bytes(fmt, k), dtype=torch.uint8)  # as the lane stores it
                    q8_epilogue.gemv_q8_gate_up_glu_q8(
                        empty_q8(1, k, "cpu"),
                        pair,
                        pair,
                        fmt,
                        n,
                        k,
                        torch.zeros(1, n),
                        empty_q8(1, n, "cpu"),
                        q8_epilogue.q8_counters(n, "cpu"),
                    )
                    down = torch.zeros(k * stored_row_bytes(fmt, n), dtype=torch.uint8)
                    q8.gemv_q8(empty_q8(1, n, "cpu"), down, fmt, k, n, torch.zeros(1, k))
    return seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="Q3_K,Q2_K,IQ4_XS,Q4_K", help="comma-separated formats")
    ap.add_argument("--n", type=int, default=18944, help="the gated pair's rows, the down product's width")
    ap.add_argument("--k", type=int, default=3584, help="the model's width")
    args = ap.parse_args()
    formats = [Format[f] for f in args.formats.split(",")]
    print(f"{'kernel':20} {'fmt':7} {'regs':>4} {'stack':>5} {'instr':>6} {'LDG':>5} {'IDP':>5} {'a dp4a':>6}", end="")
    print("".join(f" {name:>5}" for name in SHOWN))
    for name, fmt, cubin in compiled(formats, args.n, args.k):
        c = counts(cubin)
        regs, stack = resources(cubin)
        total, loads, dp4a = sum(c.values()), sum(v for op, v in c.items() if op.startswith("LDG")), c["IDP"]
        row = f"{name:20} {fmt.name:7} {regs:4d} {stack:5d} {total:6d} {loads:5d} {dp4a:5d} {total / max(dp4a, 1):6.1f}"
        print(row + "".join(f" {c[op]:5d}" for op in SHOWN))


if __name__ == "__main__":
    main()
