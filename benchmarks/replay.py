"""Timing a captured CUDA graph's replay, and each kernel's GPU time in an eager run, shared by the benchmarks
that time whole steps or runs of launches."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch

BATCHES = 3


def best_replay(graph: torch.cuda.CUDAGraph, replays: int, batches: int = BATCHES) -> float:
    """Seconds a replay of `graph` takes: the best of `batches` batches of `replays` replays, each batch timed
    from an idle GPU to the end of its last replay."""
    best = float("inf")
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / replays)
    return best


def print_kernel_times(run: Callable[[], None], top: int = 20) -> None:
    """Profile one call of `run` (eager launches) and print its kernels by total GPU time, the most first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name[:60]].append(e.device_time)
    print(f"{'kernel':60} {'count':>5} {'total us':>9} {'mean us':>8}")
    for name, times in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{name:60} {len(times):5d} {sum(times):9.1f} {sum(times) / len(times):8.2f}")
    print(f"all kernels {sum(sum(t) for t in totals.values()):.1f} us")
