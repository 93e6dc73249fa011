"""Time a cuda-lane decode step's graph replay over candidate tiles and prefetch depths of the int8 GEMVs.

Usage:
  python benchmarks/tile_sweep.py MODEL.gguf --table TALL_TILES --fmt Q4_K --tile 2,8,1 --tile 4,4,2 \
      [--depth 1 2] [--steps 300] [--knob K=V ...]
  python benchmarks/tile_sweep.py MODEL.gguf --entry GLU_TILES:Q3_K --entry TILES:Q3_K --tile 4,8,1 ...
      (each entry swept over the same tiles in turn, the model loaded once)
  python benchmarks/tile_sweep.py MODEL.gguf --set GLU_TILES:Q4_0=2,2,2 --entry TILES:Q4_0 --tile 4,4,1 ...
      (entries fixed at other tiles for the whole sweep: to time candidates together)

Each candidate (a tile of a `q8_tiles` table for one format, times each prefetch depth) is set in the module,
the step is run eagerly (compiling its kernels) and captured again, and its replay is timed: the whole step,
because a GEMV's kernel time alone misleads (`gemv_compare.py` re-reads one matrix from L2, and a kernel's
tail overlaps the next under dependent launches). The best of three batches of `--steps` replays is printed.
"""

from __future__ import annotations

import argparse

import numpy as np
from replay import best_replay

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.triton.gemv import q8 as gemv_q8
from fuselane.lanes.cuda.triton.gemv import q8_tiles
from fuselane.runtime.model import load

TABLES = ("TILES", "TALL_TILES", "SHORT_TILES", "NARROW_TALL_TILES", "GLU_TILES", "SHORT_GLU_TILES")
PROMPT = 64


def replay_ms(lane, step, steps: int) -> float:
    """Re-capture the step at the module's current tiles and time its replay (`replay.best_replay`)."""
    step.graphs.clear()
    step.runs.clear()
    for t in range(3):  # two eager runs compile, the third captures
        lane.forward(np.array([t]), PROMPT)
    return best_replay(step.graphs[None], steps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--table", choices=TABLES, default="TILES")
    ap.add_argument("--fmt", default="Q4_K", help="the format whose entry is swept (Q4_K, Q6_K, Q8_0, Q5_0, ...)")
    ap.add_argument("--entry", action="append", default=[], help="TABLE:FMT, swept in turn (repeatable)")
    ap.add_argument("--tile", action="append", default=[], help="rows,warps,per_thread (repeatable)")
    ap.add_argument("--set", action="append", default=[], help="TABLE:FMT=rows,warps,per_thread (repeatable)")
    ap.add_argument("--depth", type=int, nargs="+", default=[gemv_q8.PREFETCH_DEPTH], choices=(1, 2))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--knob", action="append", default=[], help="a lane knob, K=V (repeatable)")
    args = ap.parse_args()
    m = load(args.model, lane="cuda", ctx=args.ctx, knobs=["activations=int8", *args.knob])
    m.session().feed(list(range(100, 100 + PROMPT)))
    step = m.lane.step(1)
    for fixed in args.set:
        entry, tile = fixed.split("=")
        table_name, fmt_name = entry.split(":")
        getattr(q8_tiles, table_name)[Format[fmt_name]] = parse_tile(tile)
        print(f"{table_name}[{fmt_name}] set to {parse_tile(tile)}")
    entries = [e.split(":") for e in args.entry] or [(args.table, args.fmt)]
    for table_name, fmt_name in entries:
        sweep(m.lane, step, args, getattr(q8_tiles, table_name), table_name, Format[fmt_name])


def parse_tile(text: str) -> tuple[int, int, int]:
    """`rows,warps,per_thread` as a tile."""
    rows, warps, per_thread = (int(v) for v in text.split(","))
    return rows, warps, per_thread


def sweep(lane, step, args, table: dict, table_name: str, fmt: Format) -> None:
    """Time the step at each tile of `args.tile` (and prefetch depth) set as `table[fmt]`, then restore it."""
    landed, landed_depth = table[fmt], gemv_q8.PREFETCH_DEPTH
    tiles = [parse_tile(t) for t in args.tile] or [landed]
    print(f"{args.model}: {table_name}[{fmt.name}] (landed {landed}, depth {landed_depth})")
    try:
        for tile in tiles:
            for depth in args.depth:
                table[fmt], gemv_q8.PREFETCH_DEPTH = tile, depth
                try:
                    print(f"  tile {tile} depth {depth}: {replay_ms(lane, step, args.steps):.3f} ms", flush=True)
                except Exception as e:  # a tile the plan or the compiler refuses: say so, go on
                    print(f"  tile {tile} depth {depth}: refused ({type(e).__name__}: {str(e)[:80]})", flush=True)
    finally:
        table[fmt], gemv_q8.PREFETCH_DEPTH = landed, landed_depth


if __name__ == "__main__":
    main()
