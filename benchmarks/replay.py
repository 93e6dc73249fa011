"""Timing a captured CUDA graph's replay, shared by the benchmarks that time whole steps or runs of launches."""

from __future__ import annotations

import time

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
