"""Benchmark of the cpu lane: load time, prefill and decode tokens/s, and peak memory for one model.

Usage: python benchmarks/cpu_bench.py [MODEL] [-p 128] [-n 32] [--json]
Each figure is one measured run on an otherwise idle machine (the lane is deterministic, so repeats only
measure the machine's noise); peak memory is the process's maximum resident set, which counts the pages of
the mapped file that were touched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time

import numpy as np

from fuselane.runtime.model import load

KIB = 1024


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB  # Linux reports KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens for prefill")
    ap.add_argument("-n", type=int, default=32, help="decode steps")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = load(args.model, lane="cpu", ctx=args.p + args.n + 1)
    t1 = time.perf_counter()
    model.lane.warm()
    t2 = time.perf_counter()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.cfg.vocab // 2, args.p).tolist()
    session = model.session()
    session.feed(prompt)
    t3 = time.perf_counter()
    for _ in range(args.n):
        session.extend([int(rng.integers(0, model.cfg.vocab // 2))])
    t4 = time.perf_counter()
    result = {
        "model": str(model.path.name),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "open_s": round(t1 - t0, 3),
        "dequantize_s": round(t2 - t1, 3),
        "prefill_tokens": args.p,
        "prefill_tok_s": round(args.p / (t3 - t2), 2),
        "decode_tokens": args.n,
        "decode_tok_s": round(args.n / (t4 - t3), 2),
        "file_mb": round(model.file.size / 1e6, 1),
        "dequantized_mb": round(model.lane.dequantized_bytes() / 1e6, 1),
        "peak_rss_mb": round(peak_rss_bytes() / 1e6, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:16} {value}")


if __name__ == "__main__":
    main()
