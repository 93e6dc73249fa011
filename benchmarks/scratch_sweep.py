"""A 512-token prompt's time and GPU memory under `prefill=f16-copy` and under `prefill=f16-scratch` at several
scratch sizes (`kernels.F16_SCRATCH_VALUES`), on a GPU.

Usage: python benchmarks/scratch_sweep.py MODEL.gguf [--mib 0 64 32 16] [--chunk 512] [--no-copies]   (0: every matrix
whole)
`--chunk` runs every setting's prompt in chunks of that many rows (default: each knob's own, 256 rows for the
copies and `kernels.SCRATCH_CHUNK_ROWS` for the scratch), so the two knobs can be set side by side at one chunk.
Each setting loads the model afresh, feeds the prompt twice to warm it, then times five feeds (the best is
printed) and prints the peak GPU memory over what the lane holds (matrices as stored, norms, KV cache), the
figure the 5 % bound of `tests/cuda/test_prefill_memory.py` is on.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from fuselane.lanes.cuda.plan import kernels
from fuselane.runtime.model import load
from fuselane.runtime.session import Session

PROMPT, FEEDS, WARM = 512, 5, 2
EVERY_MATRIX = 2**40  # f16 values past any matrix: each multiplied whole


def _held(lane) -> int:
    held = sum(w.numel() for w, _ in lane.raw.values()) + sum(v.numel() * 4 for v in lane.vec.values())
    return held + sum(c.numel() * c.element_size() for c in lane.caches.values())


def run(path: str, knob: str, values: int | None, chunk: int | None = None) -> None:
    if values is not None:
        kernels.F16_SCRATCH_VALUES = values
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    m = load(path, lane="cuda", ctx=1024, knobs=[knob])
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab, size=PROMPT).tolist()
    for _ in range(WARM):
        Session(m.lane, chunk=chunk).feed(tokens)
    best = float("inf")
    for _ in range(FEEDS):
        session = Session(m.lane, chunk=chunk)
        torch.cuda.synchronize()
        start = time.perf_counter()
        session.feed(tokens)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    peak, held = torch.cuda.max_memory_allocated() - before, _held(m.lane)
    scratch = m.lane._scratch.numel() * 2 / 1e6 if m.lane._scratch is not None else 0.0
    rate = f"{best * 1e3:.2f} ms = {PROMPT / best:,.0f} tok/s"
    memory = f"peak {peak / 1e9:.3f} GB, held {held / 1e9:.3f} GB, over {100 * (peak / held - 1):.2f} %"
    print(f"{knob} scratch {scratch:.1f} MB, {session.chunk}-row chunks: {rate}; {memory}", flush=True)
    m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--mib", nargs="+", type=int, default=[0, 64, 32, 16], help="scratch sizes (0: every matrix whole)")
    ap.add_argument("--chunk", type=int, default=None, help="a prompt's chunk rows (default: each knob's own)")
    ap.add_argument("--no-copies", action="store_true", help="the scratch's sizes only, not prefill=f16-copy first")
    args = ap.parse_args()
    if not args.no_copies:
        run(args.model, "prefill=f16-copy", None, args.chunk)
    for mib in args.mib:
        run(args.model, "prefill=f16-scratch", mib * 2**20 // 2 if mib else EVERY_MATRIX, args.chunk)


if __name__ == "__main__":
    main()
