"""What the chunked gated delta rule (`triton/gdn/chunked.py`, a hybrid's prefill chunk) takes alone at a model's
widths, in µs a launch, for each product precision, solve of the chunk's system, value columns a program and
warps: one table.

Usage (on a GPU):
    python benchmarks/gdn_chunked.py [--rows 512] [--heads 32] [--key-heads 16] [--dk 128] [--dv 128]
        [--bv 32 64 128] [--warps 4 8] [--precision tf32x3 ieee] [--solve rows blocks] [--form split whole]
        [--kernels]

The defaults are Qwen3-Next-80B-A3B's linear layers (16 key heads, 32 value heads of 128) over a 512-row chunk.
Each candidate is timed with CUDA events, the median of 20 launches after 3 warm-up ones, on inputs drawn as a
layer makes them (keys L2-normed, decays and betas in their ranges); a candidate that does not compile is
reported and skipped. The figure to compare with a model's chunk: `benchmarks/profile_prefill.py`.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
from replay import print_kernel_times

from fuselane.lanes.cuda.triton.gdn import chunked

WARMUP = 3
REPEATS = 20


def _inputs(rows: int, heads: int, key_heads: int, dk: int, dv: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    draw = lambda *shape: torch.randn(shape, device="cuda", generator=gen)  # noqa: E731
    k = torch.nn.functional.normalize(draw(rows, key_heads, dk), dim=-1)
    q = torch.nn.functional.normalize(draw(rows, key_heads, dk), dim=-1)
    return dict(
        q=q, k=k, v=draw(rows, heads * dv), g=-torch.exp(draw(rows, heads)), beta=torch.sigmoid(draw(rows, heads)),
        state=torch.zeros((heads, dk, dv), device="cuda"), out=torch.empty((rows, heads * dv), device="cuda"),
        scratch=torch.empty(chunked.split_values(rows, heads, dk, dv), device="cuda"),
    )  # fmt: skip


def _median_us(launch) -> float:
    for _ in range(WARMUP):
        launch()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--bv", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--precision", nargs="+", default=list(chunked.PRECISIONS))
    ap.add_argument("--solve", nargs="+", default=list(chunked.SOLVES))
    ap.add_argument("--form", nargs="+", default=list(chunked.FORMS))
    ap.add_argument("--kernels", action="store_true", help="each candidate's kernels' GPU time too (torch.profiler)")
    a = ap.parse_args()
    x = _inputs(a.rows, a.heads, a.key_heads, a.dk, a.dv)
    shape = dict(rows=a.rows, heads=a.heads, key_heads=a.key_heads, dk=a.dk, dv=a.dv, scale=a.dk**-0.5)
    print(f"chunked delta rule: {a.rows} rows, {a.heads} value heads ({a.key_heads} key heads), dk {a.dk}, dv {a.dv}")
    print("| form | precision | solve | value columns a program | warps | µs a launch |")
    print("|---|---|---|---:|---:|---:|")
    for form, precision, solve, bv, warps in itertools.product(a.form, a.precision, a.solve, a.bv, a.warps):
        run = dict(form=form, precision=precision, solve=solve, bv=bv, warps=warps)
        row = f"| {form} | {precision} | {solve} | {bv} | {warps} |"

        def launch(run=run):
            chunked.chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], x["out"], write_state=True,
                            scratch=x["scratch"], **run, **shape)  # fmt: skip

        try:
            us = _median_us(launch)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
            print(f"{row} failed: {type(e).__name__}: {str(e)[:80]} |", flush=True)
            continue
        print(f"{row} {us:,.1f} |", flush=True)
        if a.kernels:  # the split form's two launches apart
            print_kernel_times(launch)


if __name__ == "__main__":
    main()
