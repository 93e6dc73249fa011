"""Where a cuda-lane prefill chunk's time goes: the captured chunk's replay, and each kernel's GPU time in one
eager run of it (torch.profiler).

Usage: python benchmarks/profile_prefill.py MODEL.gguf [--rows 256] [--depth 0] [--repeats 20] [--knob K=V ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from replay import print_kernel_times

from fuselane.runtime.model import load

WARM = 3  # runs of the chunk before it is timed: compiling, the f16 copies, then the graph's capture
TOP = 15


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--depth", type=int, default=0, help="tokens in the cache before the chunk")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--knob", action="append", default=[], help="a lane knob, K=V (repeatable)")
    args = ap.parse_args()
    m = load(args.model, lane="cuda", ctx=args.depth + args.rows + 1, knobs=args.knob)
    lane = m.lane
    ids = np.arange(args.rows) % 1000 + 100
    for _ in range(WARM):
        lane.forward(ids, args.depth)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.repeats):
        lane.forward(ids, args.depth)
    torch.cuda.synchronize()
    chunk = (time.perf_counter() - start) / args.repeats
    step = lane.step(args.rows)
    print(f"{args.rows} rows at depth {args.depth}: {chunk * 1e3:.3f} ms a chunk ({args.rows / chunk:,.0f} tok/s)")
    print(f"launches {step.launches}, graph captured: {bool(step.graphs)}")
    print_kernel_times(step.eager, TOP)


if __name__ == "__main__":
    main()
