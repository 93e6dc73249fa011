"""What a prefill chunk's grouped expert GEMM (`triton.moe.grouped`) takes alone, at Qwen3-30B-A3B's widths:
the gate/up launch (both products and the SwiGLU) and the down launch (the products times the route weights,
the combine, the residual and the next norm), in µs, achieved TFLOPS and GB/s; and, for the whole mixture's
three launches, the routing launch before them (router scores, top-k, the sort and the counts) on its own
drawn routing.

Usage: python benchmarks/moe_prefill.py [--rows 512] [--experts 128] [--top 8] [--d 2048] [--dff 768]
[--gate-up Q4_K] [--down Q4_K] [--block-m 64] [--block-n-gate-up 32] [--block-n-down 32] (on a GPU).

Routing is drawn uniformly (each row's top-k distinct experts), sorted and counted on the host once: the
kernels read the same order and counts a chunk's routing launch writes. Each launch is timed with CUDA
events, the median of 20 after 3 warm-up launches. The weights are random bytes: speed does not depend on
their values (a block's scales may decode to NaN, which costs the arithmetic nothing). FLOPs count the
products' 2 * pairs * n * k; bytes count the weights of the experts some pair routes to (each once), the
activations read and the results written.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from fuselane.gguf.formats import Format, row_bytes
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton.moe import grouped, route
from fuselane.lanes.cuda.triton.moe import grouped_combine as gc

WARMUP, TIMED = 3, 20
MODEL_LAYERS = 48  # Qwen3-30B-A3B's
EPS = 1e-6
F32 = 4


def _median_us(launch) -> float:
    for _ in range(WARMUP):
        launch()
    times = []
    for _ in range(TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _report(name: str, us: float, flops: float, nbytes: float) -> None:
    print(f"{name:8s} {us:9.1f} µs  {flops / us / 1e6:7.1f} TFLOPS  {nbytes / us / 1e3:7.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--dff", type=int, default=768)
    ap.add_argument("--gate-up", default="Q4_K")
    ap.add_argument("--down", default="Q4_K")
    ap.add_argument("--block-m", type=int, default=kernels.MOE_GEMM_BLOCK_M)
    ap.add_argument("--block-n-gate-up", type=int, default=kernels.MOE_GATE_UP_BLOCK_N)
    ap.add_argument("--block-n-down", type=int, default=kernels.MOE_DOWN_BLOCK_N)
    a = ap.parse_args()
    dev = torch.device("cuda")
    fgu, fd = Format[a.gate_up], Format[a.down]
    rows, experts, k, d, dff = a.rows, a.experts, a.top, a.d, a.dff
    pairs = rows * k

    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(rows)]).reshape(-1)
    order = torch.from_numpy(np.argsort(ids, kind="stable").astype(np.int32)).to(dev)
    counts_np = np.bincount(ids, minlength=experts).astype(np.int32)
    counts = torch.from_numpy(counts_np).to(dev)
    used = int((counts_np > 0).sum())

    def weights(fmt: Format, n: int, kk: int) -> torch.Tensor:
        return torch.randint(0, 256, (experts * n * row_bytes(fmt, kk),), dtype=torch.uint8, device=dev)

    wg, wu, wd = weights(fgu, dff, d), weights(fgu, dff, d), weights(fd, d, dff)
    x = torch.randn(rows, d, device=dev)
    h = torch.empty(pairs, dff, device=dev)
    h_down = torch.randn(pairs, dff, device=dev)  # gate/up's output from random-byte weights may hold NaN
    rw = torch.rand(rows, k, device=dev)
    sum_out, normed, res = (torch.randn(rows, d, device=dev) for _ in range(3))
    width_tiles = -(-d // a.block_n_down)
    c = gc.Combine(sum_out, gc.counters(rows, width_tiles, dev), (res,),
                   gc.GroupedNorm(torch.ones(d, device=dev), EPS, normed))  # fmt: skip
    pair_out = torch.empty(pairs * d, device=dev)

    def gate_up() -> None:
        grouped.gate_up_grouped(x, wg, wu, fgu, experts, k, order, counts, dff, d, h, block_m=a.block_m,
                                block_n=a.block_n_gate_up)  # fmt: skip

    def down() -> None:
        grouped.down_grouped(h_down, wd, fd, experts, order, counts, rw, d, dff, pair_out, c, block_m=a.block_m,
                             block_n=a.block_n_down)  # fmt: skip

    print(f"{rows} rows, {experts} experts (top-{k}, {used} used), d {d}, expert ffn {dff}; gate/up {fgu.name}, "
          f"down {fd.name}; tiles {a.block_m} pairs x {a.block_n_gate_up} / {a.block_n_down} rows")  # fmt: skip
    gu_us, dn_us = _median_us(gate_up), _median_us(down)
    gu_bytes = 2 * used * dff * row_bytes(fgu, d) + pairs * d * F32 + pairs * dff * F32
    dn_bytes = used * d * row_bytes(fd, dff) + pairs * dff * F32 + 2 * pairs * d * F32 + 4 * rows * d * F32
    _report("gate/up", gu_us, 2 * pairs * 2 * dff * d, gu_bytes)
    _report("down", dn_us, 2 * pairs * d * dff, dn_bytes)
    total = gu_us + dn_us
    ids_dev, rweights = torch.empty(rows, k, dtype=torch.int32, device=dev), torch.empty(rows, k, device=dev)
    scores, order_r = torch.empty(rows, experts, device=dev), torch.empty(pairs, dtype=torch.int32, device=dev)
    counts_r, router = torch.empty(experts, dtype=torch.int32, device=dev), torch.randn(experts, d, device=dev)
    rcount = route.counters(dev, rows)

    def routing() -> None:
        route.route(x, router.view(torch.uint8).view(-1), Format.F32, experts, k, True, ids_dev, rweights, scores,
                    rcount, order_r, counts_r)  # fmt: skip

    rt_us = _median_us(routing)
    _report("route", rt_us, 2 * rows * experts * d, router.numel() * F32 + x.numel() * F32)
    total += rt_us
    chunk_ms = MODEL_LAYERS * total / 1e3
    print(f"all      {total:9.1f} µs a layer; {MODEL_LAYERS} layers: {chunk_ms:.2f} ms a {rows}-row chunk")


if __name__ == "__main__":
    main()
