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


def print_replay_timeline(graph: torch.cuda.CUDAGraph, replays: int = 10, top: int = 20) -> None:
    """Profile `replays` replays of `graph` and print where their wall time goes, by kernel: the time each kernel
    holds the timeline's end (from the later of its start and the last end before it, to its own end) and the
    idle time before it (no kernel of the step running). Under dependent launches a kernel starts while the one
    before it runs and waits, so its own duration overlaps; this split adds up to the replays' GPU time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name[:60])
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not kernels:
        print("the profiler recorded no kernel of the replays")
        return
    held: dict[str, float] = defaultdict(float)
    idle: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    frontier = kernels[0][0]
    for start, end, name in kernels:
        idle[name] += max(0.0, start - frontier)
        held[name] += max(0.0, end - max(start, frontier))
        count[name] += 1
        frontier = max(frontier, end)
    print(f"{'kernel (replays)':60} {'count':>5} {'holds us':>9} {'idle us':>8}  (a replay's)")
    for name in sorted(held, key=lambda n: -(held[n] + idle[n]))[:top]:
        print(f"{name:60} {count[name] // replays:5d} {held[name] / replays:9.1f} {idle[name] / replays:8.1f}")
    span = (frontier - kernels[0][0]) / replays
    print(f"a replay: {span:.1f} us, of which idle {sum(idle.values()) / replays:.1f} us")
