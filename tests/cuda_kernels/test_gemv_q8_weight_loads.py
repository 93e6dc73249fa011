"""The int8 GEMVs' `weight_loads` knob (`triton/gemv/weight_loads.py`): `ahead` sums the same bytes in the same
order as `as-written`, so every product is the default's bit for bit (interpreted here, compiled on a GPU);
the knob reaches the kernels' `FENCE` constexpr, from a launcher and from the lane; and, compiled for sm_90
without a GPU, `ahead`'s weight loads are the coherent ones and ptxas issues each chunk's ahead of the sums
before it (read from the SASS), where `as-written`'s are the read-only ones."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import CUDA, DEVICE, dev, raw_weights  # noqa: E402

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.lanes.cuda.plan.knobs import WeightLoads  # noqa: E402
from fuselane.lanes.cuda.triton import quant  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.q8 import gemv_q8, gemv_q8_gate_up_glu, tile_plan  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.weight_loads import FENCED, PINNED, weight_loads  # noqa: E402

N = 5  # rows: two tiles of the small tile below, the second partial
SMALL_TILE = {"block_n": 4, "warps": 1, "per_thread": 1}  # several chunks a row at these widths
# a format for each kind of load the knob switches: `ld4` (Q4_K, Q5_K, Q8_0's rows of whole 16-byte units), `ld_run`
# (Q6_K, Q4_0), `ld_words` (Q2_K), `ld2` (Q8_0's rows that end on 8 bytes: 800 values)
FORMATS = {Format.Q4_K: 768, Format.Q6_K: 768, Format.Q5_K: 768, Format.Q2_K: 1792, Format.Q4_0: 800, Format.Q8_0: 1024}
LD2_ROWS = {Format.Q8_0: 800}


def test_the_fence_follows_the_mode() -> None:
    assert tile_plan(Format.Q4_K, 1024, None, None, None)["FENCE"] == FENCED
    with weight_loads(WeightLoads.AHEAD):
        assert tile_plan(Format.Q4_K, 1024, None, None, None)["FENCE"] == PINNED
        with weight_loads(WeightLoads.AS_WRITTEN):
            assert tile_plan(Format.Q6_K, 1024, None, None, None, glu=True)["FENCE"] == FENCED
    assert tile_plan(Format.Q6_K, 1024, None, None, None)["FENCE"] == FENCED


def _products(fmt: Format, k: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One product and one gate/up GLU over several chunks a row, under the current mode."""
    w, up = dev(raw_weights(fmt, N, k, rng)), dev(raw_weights(fmt, N, k, rng))
    x = (rng.standard_normal((1, k)) * 2.0).astype(np.float32)
    acts = quant.quantize(dev(x), quant.empty_q8(1, k, DEVICE))
    assert tile_plan(fmt, k, **SMALL_TILE)["N_UNITS"] >= 3 * tile_plan(fmt, k, **SMALL_TILE)["CHUNK"]
    out, glu = torch.full((1, N), float("nan"), device=DEVICE), torch.full((1, N), float("nan"), device=DEVICE)
    gemv_q8(acts, w, fmt, N, k, out, **SMALL_TILE)
    gemv_q8_gate_up_glu(acts, w, up, fmt, N, k, glu, **SMALL_TILE)
    return out, glu


CASES = [(f, k) for f, k in FORMATS.items()] + [(f, k) for f, k in LD2_ROWS.items()]


@pytest.mark.parametrize(("fmt", "k"), CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_ahead_sums_are_the_defaults_bit_for_bit(fmt: Format, k: int) -> None:
    plain = _products(fmt, k, np.random.default_rng(int(fmt)))
    with weight_loads(WeightLoads.AHEAD):
        ahead = _products(fmt, k, np.random.default_rng(int(fmt)))
    for a, b in zip(plain, ahead, strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


# The lane's steps compiled for sm_90 (`compile_check`: every launch of a wide chunk, a narrow one, decode
# steps and a batch, compiled instead of run) under the knob; each launch's FENCE constexpr recorded.
_LANE = """
import sys
from triton.runtime.jit import JITFunction
from fuselane.lanes.cuda.compile_check import check

fences = {}
launch = JITFunction.run

def recorded(self, *args, **kwargs):
    if "FENCE" in kwargs:
        fences.setdefault(f"{self.fn.__module__}.{self.fn.__name__}", set()).add(int(kwargs["FENCE"]))
    return launch(self, *args, **kwargs)

JITFunction.run = recorded
check(sys.argv[1], sys.argv[2:])
for name, seen in sorted(fences.items()):
    print(name, *sorted(seen))
"""


@pytest.mark.skipif(CUDA, reason="on a GPU tests/cuda/test_cuda_lane.py runs the lane under the knob")
def test_the_lane_launches_its_int8_gemvs_under_the_knob(tmp_path) -> None:
    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "q4_k_m", seed=3)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-c", _LANE, str(path), "weight_loads=ahead"]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = dict((line.split()[0], {int(v) for v in line.split()[1:]}) for line in run.stdout.splitlines())
    int8 = {name: fences for name, fences in seen.items() if ".gemv.q8" in name}
    # the decode step's int8 products: alone or in parts, the gate/up GLU and the norm's producer
    assert {"q8._parts_kernel", "q8_epilogue._q8_glu_q8_kernel"} <= {n.split("gemv.")[1] for n in int8}, seen
    assert all(fences == {PINNED} for fences in int8.values()), seen


# Compiled for sm_90 without a GPU: the gate/up GLU at the 7B's width (3,584) at its own tile (a loop over 7
# chunks) and at 4 rows and 8 warps (two chunks, no loop: the tile of the 7B's square Q4_K products), and the
# Q6_K product at the down projection's width (18,944: five chunks, unrolled). Prints, per kernel and mode,
# the kinds of the 128-bit weight loads in the PTX and the SASS order of weight loads (W), other loads (a),
# IDP.4A (d) and BAR.SYNC (|).
_COMPILE = """
import re
import triton
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.compile_check import cuobjdump, resources
from fuselane.lanes.cuda.plan.knobs import WeightLoads
from fuselane.lanes.cuda.triton.gemv import q8
from fuselane.lanes.cuda.triton.gemv.weight_loads import weight_loads

def kind(op):
    if op.startswith("LDG"):
        return "W" if ("CONSTANT" in op or ".EF" in op) else "a"
    return {"IDP": "d", "BAR": "|"}.get(op[:3], "")

def order(cubin):
    sass = cuobjdump(cubin, "-sass")
    ops = [m.group(1) for m in re.finditer(r"/\\*[0-9a-f]{4,}\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    return "".join(kind(op) for op in ops)

for mode in WeightLoads:
    for name, k, tile in (("Q4_K", 3584, (None, None, None)), ("Q4_K", 3584, (4, 8, 1)), ("Q6_K", 18944, (2, 8, 1))):
        with weight_loads(mode):
            plan = q8.tile_plan(Format[name], k, *tile, glu=True)
        warps = plan.pop("num_warps")
        consts = dict(plan, PDL=True)
        sig = {"xq": "*i8", "xd": "*fp32", "xs": "*fp32", "w_gate": "*u8", "w_up": "*u8", "n": "i32", "out": "*fp32"}
        sig |= {c: "constexpr" for c in consts}
        src = ASTSource(q8._glu_kernel, sig, constexprs={(list(sig).index(c),): v for c, v in consts.items()})
        kernel = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = kernel.asm["ptx"]
        nc = len(re.findall(r"ld\\.global\\.nc\\.L1::evict_first\\.(?:v4\\.)?b32", ptx))
        coherent = len(re.findall(r"ld\\.global\\.L1::evict_first\\.(?:v4\\.)?b32", ptx))
        regs, stack = resources(kernel.asm["cubin"])
        print(mode.value, name, k, plan["CHUNK"], regs, stack, nc, coherent, order(kernel.asm["cubin"]))
"""


def _chunks_ahead(sass: str) -> bool:
    """Whether every chunk's weight loads (a run of W) are issued before the barrier that comes before the
    sums they are ahead of: each barrier follows a run of weight loads, and no dp4a comes between a weight
    load and the next barrier."""
    between = sass.split("|")
    return all("d" not in part[part.find("W") :] for part in between[:-1] if "W" in part)


@pytest.mark.skipif(CUDA, reason="on a GPU the other tests compile and run the kernels")
def test_ahead_issues_each_chunks_loads_before_the_sums_before_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split() for line in run.stdout.splitlines()]
    assert len(rows) == 6, run.stdout
    for mode, name, k, chunk, regs, stack, nc, coherent, sass in rows:
        what = f"{mode} {name} k={k} chunk={chunk} {regs} registers: {sass}"
        assert int(stack) == 0, what  # no spills
        if mode == WeightLoads.AHEAD.value:
            assert coherent != "0" and nc == "0", what
            assert _chunks_ahead(sass), what
            prologue = sass[: sass.find("d")]
            assert prologue.count("|") >= 1 and prologue.replace("a", "").startswith("W"), what
        else:
            assert nc != "0" and coherent == "0", what
