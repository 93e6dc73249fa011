"""`benchmarks/moe_decode.py --dry-run`: the decode step's mixture launches the benchmark times (the routing,
the gate/up and the down launch at both of its variants, each with and without a folded shared expert) each run once
under the interpreter at tiny widths, so the benchmark the GPU runs is known to build and launch them all."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.plan import moe_kernels  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.q8 import PREFETCH_DEPTH  # noqa: E402
from tests.benchmark_script import load_script  # noqa: E402


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random bytes decode to NaN and inf scales
def test_the_dry_run_times_every_decode_mixture_launch(capsys):
    if torch.cuda.is_available():
        pytest.skip("the dry run is the interpreter's")
    load_script("moe_decode").main(["--model", "deepseek-v2-lite", "--dry-run", "--down", "Q5_0"])
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if "failed" in line]
    timed = [" ".join(line.split()).split(" µs")[0].rsplit(" ", 1)[0] for line in lines if " µs " in line]
    tile = f"{moe_kernels.MOE_DOWN_TILE} rows w{moe_kernels.MOE_DOWN_WARPS} t{moe_kernels.MOE_DOWN_PER_THREAD}"
    depth = {
        moe_kernels.MoeDown.SERIAL: PREFETCH_DEPTH,
        moe_kernels.MoeDown.READ_AHEAD: moe_kernels.moe_down_depth(Format.Q5_0),
    }
    downs = [f"down Q5_0{s} {v.value} {tile} d{depth[v]}" for s in ("", " +shared") for v in moe_kernels.MoeDown]
    folded = [f"gate/up Q8_0 +shared int8 shared-{form}" for form in ("f32", "int8")]
    assert timed == ["route one row", "gate/up Q8_0 int8", *folded, *downs], lines
