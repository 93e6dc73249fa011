"""Time the decode GEMVs on real shapes: the in-parts kernel (`gemv`) against the tile-streaming one
(`gemv_fast`), in GB/s of weights read, each launch replayed from a CUDA graph so no host time counts.

Usage: python benchmarks/gemv_compare.py [--tiles | --q8]   (on a GPU)
--tiles sweeps the tile-streaming kernels' tiles (rows a program, warps, (row, group)s a thread) instead;
--q8 times the int8-activation kernels (`gemv_q8`, `activations=int8`) against `gemv_fast` and sweeps their
tiles, and times the quantizing launch.

Every launch here reads the same matrix, so a matrix under the GPU's L2 (50 MB on an H200) is partly read from
L2 on its replays, and the GLU passes one matrix as both gate and up: below ~50 MB these figures overstate
what a model's decode step sees. `profile_decode.py` times the step itself.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

from fuselane.gguf.formats import LAYOUTS, Format, row_bytes
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.run.stored import stored_bytes
from fuselane.lanes.cuda.triton import quant
from fuselane.lanes.cuda.triton.gemv import fast as F
from fuselane.lanes.cuda.triton.gemv import q8 as Q
from fuselane.lanes.cuda.triton.gemv import rows as G

SHAPES = [  # (name, format, n, k)
    ("8b q/o", Format.Q4_K, 4096, 4096),
    ("8b gate", Format.Q4_K, 12288, 4096),
    ("8b down", Format.Q6_K, 4096, 12288),
    ("8b head", Format.Q6_K, 151936, 4096),
    ("7b qkv", Format.Q4_K, 4608, 3584),
    ("7b gate", Format.Q4_K, 18944, 3584),
    ("7b down", Format.Q4_K, 3584, 18944),
    ("0.5b gate", Format.Q5_0, 4864, 896),
    ("0.5b head", Format.Q8_0, 151936, 896),
    ("0.6b gate", Format.Q8_0, 3072, 1024),
]
REPS = 20


def timed(fn) -> float:
    """Seconds a launch takes, replayed REPS times from one CUDA graph."""
    return timed_in_turn([fn], REPS)


def timed_in_turn(calls, reps: int) -> float:
    """Seconds a launch takes: `calls` replayed in turn, `reps` launches in all, from one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def cases():
    """Each shape of SHAPES with random weights in its format on the device, a random row and two outputs."""
    rng = np.random.default_rng(0)
    for name, fmt, n, k in SHAPES:
        raw = random_blocks(fmt, n * k // LAYOUTS[fmt].values, rng)
        w = torch.from_numpy(stored_bytes(fmt, raw, row_bytes(fmt, k))).cuda()  # as the lane stores the rows
        outs = torch.empty(1, n, device="cuda"), torch.empty(1, n, device="cuda")
        yield name, fmt, n, k, n * stored_row_bytes(fmt, k), w, torch.randn(1, k, device="cuda"), outs


def main() -> None:
    for name, fmt, n, k, nbytes, w, x, (a, b) in cases():
        slow = timed(lambda: G.gemv(x, w, fmt, n, k, a))  # noqa: B023
        fast = timed(lambda: F.gemv_fast(x, w, fmt, n, k, b))  # noqa: B023
        err = float((a - b).abs().max() / a.abs().max())
        print(
            f"{name:10} {fmt.name:5} {n}x{k} {nbytes / 1e6:7.1f} MB: gemv {nbytes / slow / 1e9:6.0f} GB/s "
            f"({slow * 1e6:7.1f} us), gemv_fast {nbytes / fast / 1e9:6.0f} GB/s ({fast * 1e6:7.1f} us), "
            f"rel diff {err:.1e}",
            flush=True,
        )


TILES = [(8, 4, 1), (4, 4, 2), (4, 4, 4), (2, 4, 2), (2, 4, 4), (4, 8, 2), (4, 2, 2), (4, 8, 1), (8, 4, 2), (16, 4, 1)]


def _sweep(call, nbytes: int, check=None) -> str:
    """GB/s of `call(block_n=, warps=, per_thread=)` under each tile of TILES (and its difference from the
    default tile's result where `check` returns it)."""
    row = []
    for bn, warps, pt in TILES:
        launch = functools.partial(call, block_n=bn, warps=warps, per_thread=pt)
        try:
            took = timed(launch)
        except Exception as e:  # a tile that does not compile or fit is reported, not fatal
            row.append(f"{bn}/{warps}/{pt}: {type(e).__name__}")
            continue
        err = check() if check else 0.0
        row.append(f"{bn}/{warps}/{pt}: {nbytes / took / 1e9:5.0f}" + ("" if err < 1e-5 else f" (diff {err:.0e})"))
    return "  ".join(row)


def tiles() -> None:
    """GB/s of the tile-streaming GEMV and gate/up GLU under each (block_n, warps, per_thread) of TILES."""
    for name, fmt, n, k, nbytes, w, x, (want, out) in cases():
        F.gemv_fast(x, w, fmt, n, k, want)
        diff = functools.partial(lambda o, t: float((o - t).abs().max() / t.abs().max()), out, want)
        print(
            f"{name:10} {fmt.name:5} gemv  "
            + _sweep(functools.partial(F.gemv_fast, x, w, fmt, n, k, out), nbytes, diff),
            flush=True,
        )
        if "gate" in name:
            glu = functools.partial(F.gemv_fast_gate_up_glu, x, w, w, fmt, n, k, out)
            print(f"{name:10} {fmt.name:5} glu   " + _sweep(glu, 2 * nbytes), flush=True)


def q8() -> None:
    """GB/s of the int8-activation GEMV against the f32 one, its tile sweep, and the quantizing launch."""
    for name, fmt, n, k, nbytes, w, x, (want, out) in cases():
        if not Q.supports(fmt, 1, k):
            continue
        acts = quant.quantize(x, quant.empty_q8(1, k, "cuda"))
        t_quant = timed(lambda: quant.quantize(x, acts))  # noqa: B023
        ref = quant.dequantize(acts)
        F.gemv_fast(ref, w, fmt, n, k, want)
        f32 = timed(lambda: F.gemv_fast(x, w, fmt, n, k, out))  # noqa: B023
        q8 = timed(lambda: Q.gemv_q8(acts, w, fmt, n, k, out))  # noqa: B023
        err = float((out - want).abs().max() / want.abs().max())
        print(
            f"{name:10} {fmt.name:5} {n}x{k}: gemv_fast {nbytes / f32 / 1e9:6.0f} GB/s ({f32 * 1e6:6.1f} us), "
            f"gemv_q8 {nbytes / q8 / 1e9:6.0f} GB/s ({q8 * 1e6:6.1f} us), quantize {t_quant * 1e6:5.1f} us, "
            f"diff from f32 on the same codes {err:.1e}",
            flush=True,
        )
        diff = functools.partial(lambda o, t: float((o - t).abs().max() / t.abs().max()), out, want)
        print(f"{name:10} q8 gemv " + _sweep(functools.partial(Q.gemv_q8, acts, w, fmt, n, k, out), nbytes, diff))
        if "gate" in name:
            glu = functools.partial(Q.gemv_q8_gate_up_glu, acts, w, w, fmt, n, k, out)
            f32_glu = timed(lambda: F.gemv_fast_gate_up_glu(x, w, w, fmt, n, k, out))  # noqa: B023
            print(f"{name:10} glu f32 {2 * nbytes / f32_glu / 1e9:5.0f}  q8 " + _sweep(glu, 2 * nbytes), flush=True)


if __name__ == "__main__":
    if "--tiles" in sys.argv:
        tiles()
    elif "--q8" in sys.argv:
        q8()
    else:
        main()
