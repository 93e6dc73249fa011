"""Where the grid GEMV's time goes: its launch on a step's int8 row beside probes of the same tile and shape:
one that only streams the matrix's bytes (each thread's loads as wide as the tile's layout makes them, an xor a
word), one that only gathers grid rows (two 4-byte rows a group of 8 values from a table of IQ3_S's 512 rows,
at indices hashed from row, group and step, as a file's fall), one that gathers one index a step for every
lane (one line a load: the gathers' floor), and one that gathers the spread rows from the table held in the
program (`tl.gather`, through shared memory). In microseconds a launch and GB/s of the file's bytes, each
replayed from a CUDA graph.

Why: the GEMV reads 370-850 GB/s of an H100's ~3,000 at a 7B's widths (RESULTS.md, 2026-12-07 ninth), waiting
on loads, not issue. If the spread gathers alone take about the GEMV's time and the one-index ones far less,
its bound is the L1's wavefronts of the grid rows' gathers (a warp's 32 rows of a 2 KiB table touch most of
its 16 lines), and a smaller or shared-memory table is the next step; if they take little, the fields' narrow
loads are, and wider loads a thread are; the stream says what the tile itself can read.

Usage: python benchmarks/grid_probe.py   (on a GPU)
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from gemv_compare import timed

from fuselane.gguf.formats import LAYOUTS, Format, row_bytes
from fuselane.gguf.quantize import random_blocks
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.run.stored import stored_bytes
from fuselane.lanes.cuda.triton.grid import gemv as G
from fuselane.lanes.cuda.triton.quant import empty_q8, quantize

SHAPES = [("7b gate", 18944, 3584), ("7b down", 3584, 18944), ("7b o", 3584, 3584)]  # IQ3_S, (n, k)
FMT = Format.IQ3_S
TABLE_ROWS = 512  # IQ3_S's grid: 512 rows of 4 bytes
GROUP = 8  # values a group: two grid rows, gathered as the GEMV gathers them
WORD = 4
HASH = 0x7FEB352D  # an odd multiplier that spreads consecutive keys over the table, as a file's indices fall


@triton.jit
def _stream_kernel(w, out, N: tl.constexpr, ROW_BYTES: tl.constexpr, STEPS: tl.constexpr, BLOCK_N: tl.constexpr,
                   STEP_WORDS: tl.constexpr):  # fmt: skip
    """Each program's rows' bytes, STEP_WORDS words of each a step (a thread's loads as wide as the layout
    makes them), xored together."""
    rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    base = (w + rows.to(tl.int64) * ROW_BYTES).to(tl.pointer_type(tl.int32))[:, None]
    acc = tl.zeros([BLOCK_N, STEP_WORDS], tl.int32)
    for step in tl.range(0, STEPS):
        acc ^= tl.load(base + step * STEP_WORDS + tl.arange(0, STEP_WORDS)[None, :])
    tl.store(out + tl.program_id(0), tl.sum(tl.sum(acc.to(tl.float32), axis=1), axis=0))


@triton.jit
def _gather_kernel(table, out, STEPS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                   ROWS: tl.constexpr, HASH_C: tl.constexpr, SPREAD: tl.constexpr):  # fmt: skip
    """A GEMV's gathers alone: each (row, group) of a step two rows of the table at a hashed index; where not
    SPREAD, every lane's the same index a step (one line a load: the gathers' floor)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, GROUPS)
    acc = tl.zeros([BLOCK_N, GROUPS], tl.int32)
    for step in tl.range(0, STEPS):
        key = (rows[:, None] * (STEPS * GROUPS) * SPREAD + step * GROUPS + g[None, :] * SPREAD) * HASH_C
        idx = (key.to(tl.uint32, bitcast=True) >> 16).to(tl.int32) & (ROWS - 1)
        acc += tl.load(table + idx) + tl.load(table + (idx ^ 1))
    tl.store(out + tl.program_id(0), tl.sum(tl.sum(acc.to(tl.float32), axis=1), axis=0))


@triton.jit
def _shared_gather_kernel(table, out, STEPS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                          ROWS: tl.constexpr, HASH_C: tl.constexpr):  # fmt: skip
    """`_gather_kernel`'s spread gathers from the table held in the program (`tl.gather`: Triton stages it in
    shared memory a call, a store and two barriers), a step's two rows a group in one call."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, GROUPS)
    held = tl.load(table + tl.arange(0, ROWS))
    acc = tl.zeros([BLOCK_N, GROUPS], tl.int32)
    for step in tl.range(0, STEPS):
        key = (rows[:, None] * (STEPS * GROUPS) + step * GROUPS + g[None, :]) * HASH_C
        idx = (key.to(tl.uint32, bitcast=True) >> 16).to(tl.int32) & (ROWS - 1)
        both = tl.reshape(tl.join(idx, idx ^ 1), [BLOCK_N * GROUPS * 2])
        a, b = tl.split(tl.reshape(tl.gather(held, both, 0), [BLOCK_N, GROUPS, 2]))
        acc += a + b
    tl.store(out + tl.program_id(0), tl.sum(tl.sum(acc.to(tl.float32), axis=1), axis=0))


def _launch(kernel, programs: int, warps: int, *args, **consts):
    """A call launching `kernel` over `programs` programs of `warps` warps."""
    return lambda: kernel[(programs,)](*args, **consts, num_warps=warps)


def probes(w: torch.Tensor, n: int, k: int, sink: torch.Tensor) -> dict[str, object]:
    """The probes' launches over `w` (n rows of k IQ3_S values) at the GEMV's tile for a step's row."""
    lay, tile = LAYOUTS[FMT], G.grid_tile(n, 1)
    programs, row_b = triton.cdiv(n, tile.block_n), stored_row_bytes(FMT, k)
    # the stream's step: about the bytes a GEMV step reads of a row (its slice's share), in whole words
    step_words = triton.next_power_of_2(max(1, lay.nbytes * tile.slice // lay.values // WORD))
    table = torch.randint(0, 1 << 30, (TABLE_ROWS,), dtype=torch.int32, device=w.device)
    gathers = dict(
        STEPS=k // tile.slice, BLOCK_N=tile.block_n, GROUPS=tile.slice // GROUP, ROWS=TABLE_ROWS, HASH_C=HASH
    )
    return {
        "stream": _launch(_stream_kernel, programs, tile.warps, w, sink, N=n, ROW_BYTES=row_b,
                          STEPS=row_b // (step_words * WORD), BLOCK_N=tile.block_n, STEP_WORDS=step_words),
        "gathers": _launch(_gather_kernel, programs, tile.warps, table, sink, SPREAD=1, **gathers),
        "one row": _launch(_gather_kernel, programs, tile.warps, table, sink, SPREAD=0, **gathers),
        "held": _launch(_shared_gather_kernel, programs, tile.warps, table, sink, **gathers),
    }  # fmt: skip


def main() -> None:
    rng = np.random.default_rng(0)
    heads = "".join(f"{h:>15}" for h in ("GEMV", "stream", "gathers", "one row", "held"))
    print(f"{'product':10} {'tile':>9}{heads}  us (GB/s)")
    for name, n, k in SHAPES:
        raw = random_blocks(FMT, n * k // LAYOUTS[FMT].values, rng)
        w = torch.from_numpy(stored_bytes(FMT, raw, row_bytes(FMT, k))).cuda()
        x = quantize(torch.randn(1, k, device="cuda"), empty_q8(1, k, "cuda"))
        y = torch.empty(1, n, device="cuda")
        tile = G.grid_tile(n, 1)
        sink = torch.empty(triton.cdiv(n, tile.block_n), device="cuda")
        launches = {"gemv": lambda: G.gemv_grid(x, w, FMT, n, k, y)} | probes(w, n, k, sink)  # noqa: B023
        nbytes = n * stored_row_bytes(FMT, k)
        cells = [f"{t * 1e6:7.1f} ({nbytes / t / 1e9:4.0f})" for t in (timed(call) for call in launches.values())]
        print(f"{name:10} {f'{tile.block_n}/{tile.warps}/{tile.slice}':>9} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
