"""The decode mixture's launches as compiled for sm_90 without a GPU (read from the SASS, through their own
launchers at Qwen3-30B-A3B's widths): the down launch issues every kept expert's weight loads, all of a row's
chunks, before its first dp4a (`moe/down.py`: pinned ahead, not sunk one chunk at a time below the last
chunk's sums), and its ids and first chunks before it waits for the launch before; the gate/up launch waits
before it releases the next (what makes the down's early ids safe); the routing launch of one row issues its
router row's loads before its wait (`moe/route.py`, `_router_row`). Under MoeDown.READ_AHEAD (the
table's) the down launch loads nothing between its last dp4a and its count (the route weights and the
residual read ahead, `moe/down_rows.py`), and at three chunks in flight all three of a row's before its wait.
None spills."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from kernel_checks import CUDA  # noqa: E402

from fuselane.gguf.formats import QK_K, Format  # noqa: E402
from fuselane.lanes.cuda.plan import moe_kernels as table  # noqa: E402

DFF = 768  # Qwen3-30B-A3B's experts (the compile's widths): three super-blocks, a chunk each

# Prints, a launch a line: its name, format, stack bytes and the SASS order of weight loads (W: the
# evict-first loads the int8 GEMV gives weights), other loads (a), IDP.4A (d), BAR.SYNC (|), the wait for
# the launch before (w: ACQBULK), the release of the next (r: PREEXIT) and the count of a program done (c: ATOMG).
_COMPILE = """
import re
import torch, triton
from triton.runtime.jit import JITFunction
from fuselane.gguf.formats import Format, row_bytes
from fuselane.lanes.cuda.compile_check import Report, compiling, cuobjdump, resources

D, DFF, EXPERTS, TOP = 2048, 768, 128, 8

def kind(op):
    if op.startswith("LDG"):
        return "W" if ".EF" in op else "a"
    return {"IDP": "d", "BAR": "|", "ACQ": "w", "PRE": "r", "ATO": "c"}.get(op[:3], "")

def order(cubin):
    sass = cuobjdump(cubin, "-sass")
    ops = [m.group(1) for m in re.finditer(r"/\\*[0-9a-f]{4,}\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    return "".join(kind(op) for op in ops)

seen = []
with compiling(90, Report()):
    from fuselane.lanes.cuda.triton import pdl
    from fuselane.lanes.cuda.triton.moe import down, gate_up, route
    from fuselane.lanes.cuda.triton.quant import empty_q8

    launch = JITFunction.run

    def noted(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=warmup, **kwargs)
        seen.append((self.fn.__name__, Format(kwargs["FMT"]).name, kernel))
        return kernel

    JITFunction.run = noted
    with pdl.dependent_launches(True):
        ids, weights = torch.zeros(1, TOP, dtype=torch.int32), torch.zeros(1, TOP)
        router = torch.zeros(EXPERTS * D * 4, dtype=torch.uint8)
        route.route(torch.zeros(1, D), router, Format.F32, EXPERTS, TOP, True, ids, weights,
                    torch.zeros(1, EXPERTS), route.counters("cpu"))
        wg = torch.zeros(EXPERTS * DFF * row_bytes(Format.Q4_K, D), dtype=torch.uint8)
        gate_up.gate_up(empty_q8(1, D, "cpu"), wg, wg, Format.Q4_K, ids, DFF, D, torch.zeros(TOP, DFF),
                        empty_q8(TOP, DFF, "cpu"))
        for fmt in (Format.Q4_K, Format.Q6_K):
            w = torch.zeros(EXPERTS * D * row_bytes(fmt, DFF), dtype=torch.uint8)
            norm = down.Norm(torch.zeros(D), 1e-6, torch.zeros(1, D), empty_q8(1, D, "cpu"))
            down.down_combine(empty_q8(TOP, DFF, "cpu"), w, fmt, ids, weights, D, DFF, torch.zeros(1, D),
                              adds=(torch.zeros(1, D),), norm=norm, counter=down.counters(1, "cpu"))
    JITFunction.run = launch
for name, fmt, kernel in seen:
    print(name, fmt, resources(kernel.asm["cubin"])[1], order(kernel.asm["cubin"]))
"""


@pytest.mark.skipif(CUDA, reason="on a GPU the other tests compile and run the kernels")
def test_the_decode_mixture_issues_its_weights_ahead() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {(name, fmt): (int(stack), sass) for name, fmt, stack, sass in map(str.split, run.stdout.splitlines())}
    kernels = {("_route_kernel", "F32"), ("_gate_up_kernel", "Q4_K"), ("_down_kernel", "Q4_K")}
    kernels.add(("_down_kernel", "Q6_K"))
    assert set(rows) == kernels, run.stdout
    for (name, fmt), (stack, sass) in rows.items():
        assert stack == 0, f"{name} {fmt}: {stack} stack bytes"
        if name == "_down_kernel":  # the ids and the first chunks, the wait, then every chunk before the sums
            assert sass.count("W") >= 3 and sass.rfind("W") < sass.find("d"), f"{fmt}: {sass}"
            assert sass.find("r") < sass.find("a") < sass.find("W") < sass.find("w"), f"{fmt}: {sass}"
            if table.MOE_DOWN_VARIANT is table.MoeDown.READ_AHEAD:  # the program's end waits on no load
                assert "a" not in sass[sass.rfind("d") : sass.find("c")], f"{fmt}: {sass}"
                if table.moe_down_depth(Format[fmt]) >= DFF // QK_K:  # the row's chunks all read before the wait
                    assert sass.rfind("W") < sass.find("w"), f"{fmt}: {sass}"
        elif name == "_gate_up_kernel":  # the wait, then the release
            assert sass.find("w") < sass.find("r") < sass.find("a"), sass
        else:  # the router row's loads, a barrier, then the wait
            assert sass[: sass.find("w")].replace("|", "").replace("r", "").startswith("a"), sass
