"""Where a cuda-lane decode step's time goes: graph replay alone, the host's share, and each kernel's.

Usage: python benchmarks/profile_decode.py MODEL.gguf [--steps 100] [--ctx 1024] [--depth 64] [--knob K=V ...]
    [--hold RULE ...] [--timeline]
Prints the replay time of the captured step at `--depth` tokens of context (no host copy of logits), the time
of a whole `forward` (with the copy), and the kernels of one eager step by total GPU time (torch.profiler).
Under dependent launches (`pdl`: on Hopper, on by default but in a grid-format model) a kernel starts while the
one before it runs and its time includes its wait; `--knob pdl=off` gives each kernel's own time (the replay
figures are the ones at the knobs given). `--timeline` adds the
captured step's replays profiled: each kernel's share of their wall time and the idle time before it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from replay import print_kernel_times, print_replay_timeline

from fuselane.runtime.model import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=64, help="tokens in the cache before the timed step")
    ap.add_argument("--knob", action="append", default=[], help="a lane knob, K=V (repeatable)")
    ap.add_argument("--hold", action="append", default=[], help="hold a rule back, as `explain --hold` (repeatable)")
    ap.add_argument("--timeline", action="store_true", help="where the replays' wall time goes, by kernel")
    args = ap.parse_args()
    m = load(args.model, lane="cuda", ctx=args.ctx, knobs=args.knob, held=args.hold)
    lane = m.lane
    session = m.session()
    session.feed([100 + t % 1000 for t in range(args.depth)])
    # each step at the next position: a recurrent model's state continues only where it stopped
    pos = len(session.tokens)
    for t in range(3):
        lane.forward(np.array([t]), pos + t)
    step = lane.step(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step.graphs[None].replay()
    torch.cuda.synchronize()
    replay = (time.perf_counter() - start) / args.steps
    start = time.perf_counter()
    for t in range(args.steps):
        lane.forward(np.array([t]), pos + 3 + t)
    torch.cuda.synchronize()
    whole = (time.perf_counter() - start) / args.steps
    print(f"launches a step {step.launches}; replay {replay * 1e3:.3f} ms; forward with logits {whole * 1e3:.3f} ms")
    print(f"weights {lane.weight_bytes() / 1e9:.3f} GB a token -> {lane.weight_bytes() / replay / 1e9:.0f} GB/s")
    print_kernel_times(step.eager)
    if args.timeline:
        print_replay_timeline(step.graphs[None])


if __name__ == "__main__":
    main()
