"""What a decode step's mixture launches take alone, at a model's widths and formats: the routing launch (one
row: the router's scores and the top-k), the kept experts' gate/up (both products and the SwiGLU, written as
int8 activations), and the down launch (`triton/moe/down.py`: the kept experts' down products, the weighted
combine, the residual and the next norm in its last program, written as int8 too), with and without a folded
shared expert (its SwiGLU and score in the gate/up launch, the SwiGLU in f32 products and in the kept experts'
int8 tiles, `moe_kernels.MOE_SHARED_INT8`; its down rows in the down launch); in µs and GB/s,
each down launch at every variant and tile asked for, so one GPU call can A/B.

Usage (on a GPU):
    python benchmarks/moe_decode.py [--model qwen3-30b-a3b | deepseek-v2-lite] [--down Q4_K Q6_K]
        [--variant old new] [--tile 32] [--warps 8] [--per-thread 1] [--depth 0] [--packed no yes]
        [--shared 2816 | --no-shared]
    python benchmarks/moe_decode.py --model deepseek-v2-lite --dry-run   # no GPU: TRITON_INTERPRET=1

A model preset gives the widths and the formats its Q4_K_M file holds: Qwen3-30B-A3B's 8 of 128 experts of
ffn 768, the down Q4_K or Q6_K by layer; DeepSeek-V2-Lite's 6 of 64 experts of ffn 1,408, whose down rows
are not whole super-blocks, so llama.cpp writes them Q5_0 or Q8_0 (`gguf.synth.fit_format`), and its two
shared experts (ffn 2 x 1,408 = 2,816), timed folded into both launches (gate/up in the experts' gate/up
format, down in the same fitted to 2,816 values, and a gate score row in f32, as `shared.Shared` takes them).
`--variant` names `moe_kernels.MoeDown` values (old: MoeDown.SERIAL, new: MoeDown.READ_AHEAD); `--tile`,
`--warps`, `--per-thread` and `--depth` the int8 down program's tile (`down.Tile`: weight rows a program over
every slot, warps, (row, group)s a thread, and the new order's chunks in flight), `--packed` whether the
tile's rows are over the experts themselves, not their slots (`moe_kernels.MOE_DOWN_PACKED`; the same tile where
the kept experts are a power of two in number); each takes several values, and every combination is timed.

Each launch is timed as `moe_prefill.py` times its own: a CUDA graph of 10 launches replayed (the host's time
to issue a launch not counted), the median of 20 replays after 3 warm-up launches, with dependent launches
on as the lane runs (`pdl`), though nothing precedes a launch here: a launch's early reads (the down's ids
and first weights before its wait) do not overlap a launch before it as they do in the step. The weights are
random bytes (speed does not depend on their values); the kept experts are drawn once, distinct. Bytes count
the kept experts' weights, the activations read and the results written. `--dry-run` runs every launch once
under Triton's interpreter at small widths (the µs are the host's, meaningless): the benchmark's own test.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np
import torch

from benchmarks.moe_prefill import MODELS, _median_us
from fuselane.gguf.formats import Format, row_bytes
from fuselane.gguf.synth import fit_format
from fuselane.lanes.cuda.plan import moe_kernels
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes

EPS = 1e-6
F32 = 4
Q8_BYTES = 1 + F32 / 32 + F32 / 16  # an int8 activation's code, its share of a block's scale and of a run's sum


# --dry-run's widths: a width of one 32-value block, whose gate/up (the expert's and the shared one's) are Q8_0
# for it, and a down row of one unit of its formats (`dff` is set so): a launch is a few interpreted programs
DRY = dict(experts=4, top=2, d=32, sdff=64)
DRY_GATE_UP = Format.Q8_0


class Bench:
    """A decode row's tensors at the given widths, and each launch as a closure with the bytes it moves."""

    def __init__(self, experts: int, top: int, d: int, dff: int, seed: int = 0) -> None:
        from fuselane.lanes.cuda.triton import quant

        self.dev = dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.experts, self.k, self.d, self.dff = experts, top, d, dff
        rng = np.random.default_rng(seed)
        self.ids = torch.from_numpy(rng.permutation(experts)[:top].astype(np.int32)).view(1, top).to(dev)
        self.rw = torch.rand(1, top, device=dev)
        self.x = torch.randn(1, d, device=dev)
        self.xq = quant.quantize(self.x, quant.empty_q8(1, d, dev))
        self.h = torch.empty(top, dff, device=dev)
        self.hq = quant.quantize(torch.randn(top, dff, device=dev), quant.empty_q8(top, dff, dev))
        self.res, self.sum_out, self.normed = (torch.randn(1, d, device=dev) for _ in range(3))
        self.normed_q8 = quant.empty_q8(1, d, dev)
        self.ones = torch.ones(d, device=dev)

    def weights(self, fmt: Format, n: int, kk: int, experts: int | None = None) -> torch.Tensor:
        count = self.experts if experts is None else experts
        return torch.randint(0, 256, (count * n * stored_row_bytes(fmt, kk),), dtype=torch.uint8, device=self.dev)

    def routing(self):
        from fuselane.lanes.cuda.triton.moe import route

        e, k, d, dev = self.experts, self.k, self.d, self.dev
        ids, rw = torch.empty(1, k, dtype=torch.int32, device=dev), torch.empty(1, k, device=dev)
        scores, router, counter = torch.empty(1, e, device=dev), torch.randn(e, d, device=dev), route.counters(dev)
        w = router.view(torch.uint8).view(-1)
        return (lambda: route.route(self.x, w, Format.F32, e, k, True, ids, rw, scores, counter)), router.numel() * F32

    def gate_up(self, fmt: Format, shared=None):
        from fuselane.lanes.cuda.triton.moe import gate_up

        wg, wu = self.weights(fmt, self.dff, self.d), self.weights(fmt, self.dff, self.d)
        out_q8 = type(self.hq)(*(torch.empty_like(t) for t in self.hq))
        nbytes = 2 * self.k * self.dff * row_bytes(fmt, self.d) + self.k * self.dff * (F32 + Q8_BYTES)
        s, sbytes = shared if shared is not None else (None, 0)

        def launch() -> None:
            gate_up.gate_up(self.xq, wg, wu, fmt, self.ids, self.dff, self.d, self.h, out_q8, s)

        return launch, nbytes + sbytes

    def shared(self, gfmt: Format, sdff: int):
        """A folded shared expert of `sdff` values (`shared.Shared`) and the bytes each of its launches reads:
        its gate/up and score (the gate/up launch's), its down (the down launch's)."""
        from fuselane.lanes.cuda.triton.moe import shared

        dfmt = fit_format(gfmt, sdff)
        wg, wu = self.weights(gfmt, sdff, self.d, 1), self.weights(gfmt, sdff, self.d, 1)
        wd, score = self.weights(dfmt, self.d, sdff, 1), torch.randn(1, self.d, device=self.dev) * 0.01
        s = shared.Shared(self.x, wg, wu, wd, score.view(torch.uint8).view(-1), gfmt, dfmt, Format.F32, sdff,
                          torch.zeros(sdff + 1, device=self.dev))  # fmt: skip
        return (s, wg.numel() + wu.numel() + score.numel() * F32), (s, wd.numel())

    def down(self, fmt: Format, variant: moe_kernels.MoeDown, tile, shared=None):
        from fuselane.lanes.cuda.triton.moe import down

        wd = self.weights(fmt, self.d, self.dff)
        counter = down.counters(1, self.dev)
        norm = down.Norm(self.ones, EPS, self.normed, self.normed_q8)
        s, sbytes = shared if shared is not None else (None, 0)
        nbytes = (self.k * self.d * row_bytes(fmt, self.dff) + self.k * self.dff * Q8_BYTES
                  + self.d * (4 * F32 + Q8_BYTES) + sbytes)  # fmt: skip

        def launch() -> None:
            down.down_combine(self.hq, wd, fmt, self.ids, self.rw, self.d, self.dff, self.sum_out, adds=(self.res,),
                              shared=s, norm=norm, counter=counter, variant=variant, tile=tile)  # fmt: skip

        return launch, nbytes


def _time(name: str, what: str, make) -> float | None:
    """The launch's median µs, printed with its GB/s; None (and why, one line) where it does not compile or run."""
    try:
        launch, nbytes = make()
        us = _median_us(launch)
    except Exception as e:  # a tile that does not compile (registers, shapes) is reported and skipped
        print(f"{name:18s} {what:28s} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", flush=True)
        return None
    print(f"{name:18s} {what:28s} {us:9.2f} µs  {nbytes / us / 1e3:8.1f} GB/s", flush=True)
    return us


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    for name in ("experts", "top", "d", "dff"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--shared", type=int, default=None, help="a folded shared expert's width (the model's)")
    ap.add_argument("--no-shared", action="store_true", help="no launch with a folded shared expert (gate/up or down)")
    ap.add_argument("--gate-up", default=None)
    ap.add_argument("--down", nargs="+", default=None)
    ap.add_argument("--variant", nargs="+", default=[v.value for v in moe_kernels.MoeDown],
                    choices=[v.value for v in moe_kernels.MoeDown])  # fmt: skip
    ap.add_argument("--tile", nargs="+", type=int, default=[moe_kernels.MOE_DOWN_TILE])
    ap.add_argument("--warps", nargs="+", type=int, default=[moe_kernels.MOE_DOWN_WARPS])
    ap.add_argument("--per-thread", nargs="+", type=int, default=[moe_kernels.MOE_DOWN_PER_THREAD])
    ap.add_argument(
        "--packed",
        nargs="+",
        choices=["no", "yes"],
        default=["no", "yes"],
        help="the down tile's rows over the kept experts, not their slots (moe_kernels.MOE_DOWN_PACKED)",
    )
    ap.add_argument(
        "--depth", nargs="+", type=int, default=[0],
        help="the new order's chunks in flight (0: the format's, `moe_kernels.moe_down_depth`)",
    )  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="no GPU: every launch once under TRITON_INTERPRET=1")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules import triton's JIT
    elif not torch.cuda.is_available():
        print("moe_decode: needs a GPU (or --dry-run)", file=sys.stderr)
        sys.exit(1)
    from fuselane.lanes.cuda.triton import pdl
    from fuselane.lanes.cuda.triton.gemv.q8 import PREFETCH_DEPTH
    from fuselane.lanes.cuda.triton.moe.down import Tile

    m = MODELS[a.model]
    dry = DRY if a.dry_run else {}
    experts, top, d, dff = (v if v is not None else dry.get(key, getattr(m, key)) for key, v in
                            (("experts", a.experts), ("top", a.top), ("d", a.d), ("dff", a.dff)))  # fmt: skip
    sdff = 0 if a.no_shared else a.shared if a.shared is not None else dry.get("sdff", m.sdff) if m.sdff else 0
    fgu = Format[a.gate_up] if a.gate_up else DRY_GATE_UP if a.dry_run else Format[m.gate_up]
    fds = [Format[f] for f in (a.down or m.downs)]
    if a.dry_run and a.dff is None:
        from fuselane.lanes.cuda.triton.gemv.q8 import UNIT_VALUES

        dff = max(UNIT_VALUES[f] for f in fds)
    b = Bench(experts, top, d, dff)
    print(f"{a.model}: one row, {experts} experts (top-{top}), d {d}, expert ffn {dff}, gate/up {fgu.name}, down "
          f"{' / '.join(f.name for f in fds)}" + (f", a shared expert of {sdff}" if sdff else "")
          + (" (interpreted: host µs)" if a.dry_run else ""), flush=True)  # fmt: skip
    with pdl.dependent_launches(True):
        _time("route", "one row", b.routing)
        _time(f"gate/up {fgu.name}", "int8", lambda: b.gate_up(fgu))
        folded = b.shared(fgu, sdff) if sdff else None  # (the gate/up launch's part, the down launch's)
        for tiles_q8 in (False, True) if folded is not None else ():
            # the shared expert's SwiGLU in f32 products, then as the kept experts' int8 tiles (where they take it)
            saved, moe_kernels.MOE_SHARED_INT8 = moe_kernels.MOE_SHARED_INT8, tiles_q8
            try:
                what = f"int8 shared-{'int8' if tiles_q8 else 'f32'}"
                _time(f"gate/up {fgu.name} +shared", what, lambda: b.gate_up(fgu, folded[0]))
            finally:
                moe_kernels.MOE_SHARED_INT8 = saved
        shared = [None] + ([folded[1]] if folded is not None else [])
        packs = sorted({p == "yes" for p in a.packed} if top & (top - 1) else {False})  # packing changes no tile of 2^n
        grid = itertools.product(a.tile, a.warps, a.per_thread, [d or None for d in a.depth], packs)
        tiles = [Tile(*t) for t in grid]
        for fmt, s, tile, v in itertools.product(fds, shared, tiles, a.variant):
            if tile.depth is not None and moe_kernels.MoeDown(v) is not moe_kernels.MoeDown.READ_AHEAD:
                continue  # the old order's depth is the GEMV's
            name = f"down {fmt.name}" + (" +shared" if s is not None else "")
            new = moe_kernels.MoeDown(v) is moe_kernels.MoeDown.READ_AHEAD
            depth = tile.depth or (moe_kernels.moe_down_depth(fmt) if new else PREFETCH_DEPTH)  # the old: the GEMV's
            what = f"{v} {tile.rows} rows w{tile.warps} t{tile.per_thread} d{depth}{' packed' if tile.packed else ''}"
            _time(name, what, lambda fmt=fmt, s=s, tile=tile, v=v: b.down(fmt, moe_kernels.MoeDown(v), tile, s))


if __name__ == "__main__":
    main()
