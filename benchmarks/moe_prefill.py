"""What a prefill chunk's mixture launches take alone: the routing launch (router scores, top-k, the sort and
the counts), the grouped gate/up (both products and the SwiGLU) and the grouped down (the products times the
route weights, the combine, the residual and the next norm), in µs, achieved TFLOPS and GB/s, at a model's
widths; with `--sweep`, the grouped launches at every candidate tile, one table.

Usage (on a GPU):
    python benchmarks/moe_prefill.py [--model qwen3-30b-a3b | deepseek-v2-lite] [--rows 512] [--experts N]
        [--top K] [--d D] [--dff F] [--gate-up Q4_K] [--down Q4_K Q6_K] [--block-m M] [--block-n N]
        [--warps W] [--stages S] [--step 128] [--sweep] [--budget 110]

A model preset gives the widths and the formats a Q4_K_M file holds: Qwen3-30B-A3B's experts are Q4_K with
the down Q4_K or Q6_K by layer; DeepSeek-V2-Lite's down rows (1,408 values) are not whole super-blocks, so
llama.cpp's Q4_K_M writes them Q5_0 or Q8_0 (`gguf.synth.fit_format`), which the grouped GEMM decodes unit by
unit. Without `--block-m` etc. each launch takes the table's tile (`moe_kernels.moe_gemm_tile`). `--sweep` times
the candidate tiles of every launch (a candidate that does not compile is reported and skipped) and stops
starting new ones past `--budget` seconds; it prints each line as it is timed.

The grouped launches take the row scales the routing launch writes (`route.RowScales`, computed here on the
device from the drawn activations), as the lane binds them; the lines marked * take a step's own scale instead.

Routing is drawn uniformly (each row's top-k distinct experts), sorted and counted on the host once: the
grouped kernels read the same order and counts a chunk's routing launch writes. Each launch is timed with CUDA
events as a CUDA graph of 10 launches replayed (the host's time to issue a launch not counted), the median of
20 replays after 3 warm-up launches. The weights are random bytes: speed does not depend on
their values (a block's scales may decode to NaN, which costs the arithmetic nothing). FLOPs count the
products' 2 * pairs * n * k; bytes count the weights of the experts some pair routes to (each once), the
activations read and the results written.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from fuselane.gguf.formats import Format, row_bytes
from fuselane.gguf.synth import fit_format
from fuselane.lanes.cuda.plan import moe_kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton.moe import grouped, route, words
from fuselane.lanes.cuda.triton.moe import grouped_combine as gc

WARMUP, TIMED = 3, 20
GRAPH_LAUNCHES = 10  # launches a timed CUDA graph replays
# The routing launch's registers a thread capped (ptxas sm_90, the GEMV's tile: 197 -> 128, 48 bytes spilled):
# two blocks a SM for the scores, timed beside the uncapped launch. A chunk's tensor-core tile (four warps) takes
# at most 191 (`compile_check --usage`, a Qwen3-30B-A3B layer's routing launches), so the cap may spill more.
ROUTE_MAXNREG = 128
EPS = 1e-6
F32 = 4


@dataclass(frozen=True, slots=True)
class Model:
    """A model's mixture widths, its layers, the expert formats of its Q4_K_M file, and its shared experts'
    width (0: none; the decode benchmark folds them into its down launch)."""

    experts: int
    top: int
    d: int
    dff: int
    layers: int
    gate_up: str
    downs: tuple[str, ...]
    sdff: int = 0


MODELS = {
    "qwen3-30b-a3b": Model(128, 8, 2048, 768, 48, "Q4_K", ("Q4_K", "Q6_K")),
    # the down rows' Q4_K / Q6_K fall back as llama.cpp's do (1,408 is not whole super-blocks)
    "deepseek-v2-lite": Model(
        64, 6, 2048, 1408, 26, "Q4_K", tuple(fit_format(Format[f], 1408).name for f in ("Q4_K", "Q6_K")), 2816
    ),  # fmt: skip
    # 10 of 512 experts of ffn 512 and a shared expert of 512 (its Q4_K_M file's down rows Q4_K or Q6_K by layer)
    "qwen3-next-80b-a3b": Model(512, 10, 2048, 512, 48, "Q4_K", ("Q4_K", "Q6_K"), 512),
}

# (BLOCK_M, BLOCK_N, warps, stages, word step) the sweep tries for each grouped launch, around the table's
# (`moe_kernels.MOE_WORDS_TILES`, from the first sweep: four warps won both models' Q4_K gate/up and V2-Lite's Q5_0
# down at 64 x 64; one stage of a whole super-block won Q6_K's down, and one stage Q8_0's, at 64 x 128 and
# eight warps; 64 x 256 Q4_K's down). Those most likely to win first, by the first sweep and by what ptxas
# spills (sm_90, Qwen3's widths, bytes a thread for Q4_K gate/up, down, Q6_K gate/up, down): 64 x 64 four warps
# three stages (0 / 28 / 0 / 40), 64 x 128 eight warps 256 a step (0 / 144 / 356 / 112), 64 x 64 four warps one
# stage 256 a step (0 / 248 / 524 / 632), ...; 64 x 128 four warps one stage 256 a step last (132 / 528 / 4,448
# / 2,440). Tiles of 16 and 32 pairs come first: a model of many experts and few kept (Qwen3-Next-80B-A3B:
# 512, top-10) gives each expert ~10 of a 512-row chunk's pairs, so most of a 64-pair tile is padding. A
# launch's table tile, and a candidate that runs as one already timed (a 256-value step of a row not whole
# 256-value steps runs at 128), are not timed again; `--budget` stops the rest.
CANDIDATES = [
    (16, 128, 4, 2, 128),
    (16, 64, 4, 2, 128),
    (32, 64, 4, 2, 128),
    (16, 256, 8, 2, 128),
    (32, 128, 8, 2, 128),
    (16, 128, 8, 1, 256),
    (64, 64, 4, 3, 128),
    (64, 128, 8, 2, 256),
    (64, 64, 4, 1, 256),
    (64, 128, 4, 2, 128),
    (64, 256, 8, 1, 256),
    (64, 256, 8, 2, 256),
    (64, 64, 4, 2, 256),
    (64, 128, 4, 3, 128),
    (64, 64, 4, 1, 128),
    (64, 128, 8, 1, 128),
    (64, 128, 4, 1, 256),
    (64, 128, 4, 2, 256),
]


def _median_us(launch) -> float:
    """The launch's median µs on the GPU: timed as replays of a CUDA graph of GRAPH_LAUNCHES launches (so the
    host's time to issue a launch, tens of µs through Python, is not counted), or launch by launch where the
    capture fails."""
    if not torch.cuda.is_available():  # --dry-run: the interpreter, once, by the host's clock
        t = time.perf_counter()
        launch()
        return (time.perf_counter() - t) * 1e6
    for _ in range(WARMUP):
        launch()
    run, per = launch, 1
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_LAUNCHES):
                launch()
        graph.replay()
        run, per = graph.replay, GRAPH_LAUNCHES
    except RuntimeError as e:
        print(f"  (not captured, timed launch by launch: {str(e).splitlines()[0][:80]})", flush=True)
    times = []
    for _ in range(TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    return statistics.median(times)


def _line(name: str, tile: str, us: float, flops: float, nbytes: float) -> None:
    print(f"{name:14s} {tile:34s} {us:9.1f} µs  {flops / us / 1e6:7.1f} TFLOPS  {nbytes / us / 1e3:7.1f} GB/s",
          flush=True)  # fmt: skip


def _tile_name(fmt: Format, tile: dict) -> str:
    if not tile:
        return "table"
    if "registers" in tile:
        return f"at most {tile['registers']} registers"
    said = f"{tile['block_m']}x{tile['block_n']} w{tile['warps']} s{tile['stages']}"
    return said + (f" k{tile['step']}" if words.takes(fmt) and "step" in tile else "")


def _runs_as(fmt: Format, launch: moe_kernels.MoeLaunch, n: int, k: int, tile: dict, per: float) -> tuple:
    """The tile a launch of (n, k) experts in `fmt`, `per` pairs an expert, runs at for `tile` (the table's where
    not given), its step the one `grouped.format_consts` takes (a 256-value step of a row not whole 256-value
    steps runs at 128)."""
    given = (tile.get(key) for key in ("block_m", "block_n", "warps", "stages", "step"))
    t = grouped.tile_options(fmt, launch, *given, pairs_an_expert=per)
    step = grouped.format_consts(fmt, n, k, word_step=t.step, launch=launch)["STEP_VALUES"]
    return t.block_m, t.block_n, t.warps, t.stages, step if words.takes(fmt) else None


class Bench:
    """The chunk's tensors at the given widths, and each launch as a closure."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.dev = dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.rows, self.experts, self.k, self.d, self.dff = a.rows, a.experts, a.top, a.d, a.dff
        rows, experts, k, d, dff = self.rows, self.experts, self.k, self.d, self.dff
        self.pairs = rows * k
        rng = np.random.default_rng(0)
        ids = np.stack([rng.permutation(experts)[:k] for _ in range(rows)]).reshape(-1)
        self.order = torch.from_numpy(np.argsort(ids, kind="stable").astype(np.int32)).to(dev)
        counts = np.bincount(ids, minlength=experts).astype(np.int32)
        self.counts = torch.from_numpy(counts).to(dev)
        self.used = int((counts > 0).sum())
        self.x = torch.randn(rows, d, device=dev)
        self.h = torch.empty(self.pairs, dff, device=dev)
        self.h_down = torch.randn(self.pairs, dff, device=dev)  # gate/up's output from random bytes may hold NaN
        self.rw = torch.rand(rows, k, device=dev)
        self.sum_out, self.normed, self.res = (torch.randn(rows, d, device=dev) for _ in range(3))
        self.pair_out = torch.empty(self.pairs * d, device=dev)
        self.ones = torch.ones(d, device=dev)
        # the row scales as the routing launch leaves them (the lane's path), and h's as gate/up would
        amax = self.x.abs().amax(1)
        scale = torch.where(amax > 2.0**14, torch.exp2(torch.ceil(torch.log2(amax / 2.0**14))), 1.0)
        x16 = (self.x / scale[:, None]).half()
        self.amax = route.RowScales(amax, x16, torch.zeros(self.pairs, dtype=torch.int32, device=dev))
        self.h_amax = self.h_down.abs().amax(1).view(torch.int32)

    def weights(self, fmt: Format, n: int, kk: int) -> torch.Tensor:
        size = self.experts * n * stored_row_bytes(fmt, kk)  # as the lane stores the rows
        return torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.dev)

    def gate_up(self, fmt: Format, tile: dict, step_scales: bool = False):
        wg, wu = self.weights(fmt, self.dff, self.d), self.weights(fmt, self.dff, self.d)
        args = (fmt, self.experts, self.k, self.order, self.counts, self.dff, self.d, self.h)
        flops = 2 * self.pairs * 2 * self.dff * self.d
        nbytes = 2 * self.used * self.dff * row_bytes(fmt, self.d) + self.pairs * (self.d + self.dff) * F32
        amax = None if step_scales else self.amax
        return (lambda: grouped.gate_up_grouped(self.x, wg, wu, *args, **tile, amax=amax)), flops, nbytes

    def down(self, fmt: Format, tile: dict, step_scales: bool = False):
        wd = self.weights(fmt, self.d, self.dff)
        width_tiles = grouped.down_width_tiles(fmt, self.d, tile.get("block_n"), self.pairs / self.experts)
        norm = gc.GroupedNorm(self.ones, EPS, self.normed)
        c = gc.Combine(self.sum_out, gc.counters(self.rows, width_tiles, self.dev), (self.res,), norm)
        args = (fmt, self.experts, self.order, self.counts, self.rw, self.d, self.dff, self.pair_out, c)
        flops = 2 * self.pairs * self.d * self.dff
        nbytes = (self.used * self.d * row_bytes(fmt, self.dff) + self.pairs * self.dff * F32
                  + 2 * self.pairs * self.d * F32 + 4 * self.rows * self.d * F32)  # fmt: skip
        h_amax = None if step_scales else self.h_amax
        return (lambda: grouped.down_grouped(self.h_down, wd, *args, **tile, h_amax=h_amax)), flops, nbytes

    def routing(self, maxnreg: int | None = None):
        rows, experts, k, d, dev = self.rows, self.experts, self.k, self.d, self.dev
        ids, rweights = torch.empty(rows, k, dtype=torch.int32, device=dev), torch.empty(rows, k, device=dev)
        scores, order = torch.empty(rows, experts, device=dev), torch.empty(rows * k, dtype=torch.int32, device=dev)
        counts, router = torch.empty(experts, dtype=torch.int32, device=dev), torch.randn(experts, d, device=dev)
        rcount, scratch = route.counters(dev, rows), route.sort_scratch(dev, rows, experts, k)
        amax = route.row_scales(dev, rows, k, d)

        def launch() -> None:
            route.route(self.x, router.view(torch.uint8).view(-1), Format.F32, experts, k, True, ids, rweights,
                        scores, rcount, order, counts, scratch=scratch, amax=amax, maxnreg=maxnreg)  # fmt: skip

        launch()
        want = np.argsort(ids.cpu().numpy().reshape(-1), kind="stable")
        if not np.array_equal(order.cpu().numpy(), want):
            print("route: the order is not the stable sort of the ids", flush=True)
        return launch, 2 * rows * experts * d, router.numel() * F32 + self.x.numel() * F32


def _time(name: str, fmt: Format, make, tile: dict) -> float | None:
    """The launch's median µs at `tile`, printed; None (and why, one line) where it does not compile or run."""
    try:
        launch, flops, nbytes = make(fmt, tile)
        us = _median_us(launch)
    except Exception as e:  # a candidate tile that does not compile (registers, shared memory) is skipped
        print(f"{name:14s} {_tile_name(fmt, tile):34s} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}",
              flush=True)  # fmt: skip
        return None
    _line(name, _tile_name(fmt, tile), us, flops, nbytes)
    return us


def _given(a: argparse.Namespace) -> dict:
    given = dict(block_m=a.block_m, block_n=a.block_n, warps=a.warps, stages=a.stages, step=a.step)
    return {key: v for key, v in given.items() if v is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--rows", type=int, default=512)
    for name in ("experts", "top", "d", "dff", "block-m", "block-n", "warps", "stages", "step"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--gate-up", default=None)
    ap.add_argument("--down", nargs="+", default=None)
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile of the grouped launches")
    ap.add_argument("--budget", type=float, default=110.0, help="seconds after which the sweep starts no tile")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: every launch once under TRITON_INTERPRET=1")
    a = ap.parse_args()
    if not torch.cuda.is_available() and not a.dry_run:
        print("moe_prefill: needs a GPU (or --dry-run under TRITON_INTERPRET=1)", file=sys.stderr)
        sys.exit(1)
    m = MODELS[a.model]
    a.experts, a.top, a.d, a.dff = (v if v is not None else dv for v, dv in
                                    ((a.experts, m.experts), (a.top, m.top), (a.d, m.d), (a.dff, m.dff)))  # fmt: skip
    fgu = Format[a.gate_up or m.gate_up]
    fds = [Format[f] for f in (a.down or m.downs)]
    b = Bench(a)
    print(f"{a.model}: {a.rows} rows, {a.experts} experts (top-{a.top}, {b.used} used), d {a.d}, expert ffn "
          f"{a.dff}; gate/up {fgu.name}, down {' / '.join(f.name for f in fds)}", flush=True)  # fmt: skip
    start = time.monotonic()
    rt_us = _time("route", Format.F32, lambda _f, _t: b.routing(), {})
    _time("route", Format.F32, lambda _f, _t: b.routing(ROUTE_MAXNREG), {"registers": ROUTE_MAXNREG})
    gu_us = _time(f"gate/up {fgu.name}", fgu, b.gate_up, _given(a))
    dn_us = [_time(f"down {f.name}", f, b.down, _given(a)) for f in fds]
    if None not in (rt_us, gu_us, *dn_us):
        layer = rt_us + gu_us + statistics.mean(dn_us)  # the down formats alternate by layer
        print(f"{'a layer':14s} {'':34s} {layer:9.1f} µs; {m.layers} layers: {m.layers * layer / 1e3:.2f} ms a "
              f"{a.rows}-row chunk's mixture", flush=True)  # fmt: skip
    for f, make in [(fgu, b.gate_up)] + [(f, b.down) for f in fds]:  # a step's own scale: the k loop's branch
        name = ("gate/up " if make == b.gate_up else "down ") + f.name
        _time(name + " *", f, lambda fmt, tile, make=make: make(fmt, tile, step_scales=True), _given(a))
    print("(* a step's own f16 scale, the branch in the k loop: the path without the routing launch's row scales)",
          flush=True)  # fmt: skip
    if not a.sweep:
        return
    print("sweep (BLOCK_M x BLOCK_N, warps, stages, values a step of the word decode):", flush=True)
    table = [(f"gate/up {fgu.name}", gu_us)] + [(f"down {f.name}", us) for f, us in zip(fds, dn_us, strict=True)]
    best = {name: (us, "table") for name, us in table if us is not None}  # the table's tile, timed above
    gu, dn = moe_kernels.MoeLaunch.GATE_UP, moe_kernels.MoeLaunch.DOWN
    jobs = [(f"gate/up {fgu.name}", fgu, b.gate_up, gu, (a.dff, a.d))]
    jobs += [(f"down {f.name}", f, b.down, dn, (a.d, a.dff)) for f in fds]
    per = b.pairs / b.experts
    timed = {name: {_runs_as(fmt, launch, *nk, _given(a), per)} for name, fmt, _, launch, nk in jobs}
    for bm, bn, warps, stages, step in CANDIDATES:
        for name, fmt, make, launch, nk in jobs:
            if time.monotonic() - start > a.budget:
                print(f"budget of {a.budget:.0f} s spent: the sweep stops here", flush=True)
                return _best(best)
            tile = dict(block_m=bm, block_n=bn, warps=warps, stages=stages, step=step)
            runs_as = _runs_as(fmt, launch, *nk, tile, per)
            if runs_as in timed[name]:
                continue  # the table's tile, or one timed already under another name
            timed[name].add(runs_as)
            tile["step"] = runs_as[-1]
            us = _time(name, fmt, make, tile)
            if us is not None and (name not in best or us < best[name][0]):
                best[name] = (us, _tile_name(fmt, tile))
    _best(best)


def _best(best: dict[str, tuple[float, str]]) -> None:
    for name, (us, tile) in best.items():
        print(f"best {name:9s} {tile:34s} {us:9.1f} µs", flush=True)


if __name__ == "__main__":
    main()
