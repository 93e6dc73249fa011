"""What the add + RMS norm epilogue costs an int8 decode GEMV: the same products launched with the norm
(`gemv_q8_add_norm`: every program counts itself done, the last reads the row back, norms and quantizes it),
without it (`gemv_q8` with the residual added in its epilogue), and with the add and norm in a launch of
their own after the product (`gemv_q8`, then `norm.rms_norm` writing the int8 form: the lane's
`norm_launch=on`), in µs a product and GB/s of weights.

Usage: python benchmarks/add_norm_tail.py [--fmt Q4_K] [--n 4096] [--k 12288] [--launches 36] [--pdl on|off]
(on a GPU). Defaults: the 8B's down projection.

Each variant is `--launches` launches over as many distinct matrices (more bytes than the H200's 50 MB of L2,
so every launch reads its weights from memory, as a model's step does), captured in one CUDA graph and replayed;
the best of three batches of replays counts. The weights are random bytes: speed does not depend on their
values (a block's scales may decode to NaN, which costs the arithmetic nothing).
"""

from __future__ import annotations

import argparse

import torch
from replay import best_replay

from fuselane.gguf.formats import Format
from fuselane.lanes.cuda.plan.kernels import stored_row_bytes
from fuselane.lanes.cuda.triton import norm, pdl, quant
from fuselane.lanes.cuda.triton.gemv import q8 as gemv_q8
from fuselane.lanes.cuda.triton.gemv import q8_epilogue as gemv_q8_epilogue
from fuselane.lanes.cuda.triton.gemv.epilogue import gemv_add_norm_counter

REPLAYS = 20
EPS = 1e-6


def _time(launches, on: bool) -> float:
    """Seconds a replay of `launches` takes in one CUDA graph, made as dependents where `on`."""
    with pdl.dependent_launches(on):
        for launch in launches:  # compile first
            launch()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for launch in launches:
                launch()
    return best_replay(graph, REPLAYS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="Q4_K")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=12288)
    ap.add_argument("--launches", type=int, default=36)
    ap.add_argument("--pdl", choices=("on", "off"), default="on")
    args = ap.parse_args()
    fmt, n, k, dev = Format[args.fmt], args.n, args.k, torch.device("cuda")
    nbytes = stored_row_bytes(fmt, k) * n  # as the lane stores the rows
    weights = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev) for _ in range(args.launches)]
    x = quant.quantize(torch.randn(1, k, device=dev), quant.empty_q8(1, k, dev))
    res, sum_out, out = (torch.randn(1, n, device=dev) for _ in range(3))
    norm_w = torch.randn(n, device=dev)
    out_q8, counter = quant.empty_q8(1, n, dev), gemv_add_norm_counter(dev)

    def with_norm(w):
        add_norm = gemv_q8_epilogue.gemv_q8_add_norm
        return lambda: add_norm(x, w, fmt, n, k, res, sum_out, norm_w, EPS, out, out_q8, counter)

    def plain(w):
        return lambda: gemv_q8.gemv_q8(x, w, fmt, n, k, sum_out, residual=res)

    product = torch.empty(1, n, device=dev)

    def norm_launch(w):
        def both():
            gemv_q8.gemv_q8(x, w, fmt, n, k, product)
            norm.rms_norm(product, norm_w, out, EPS, residual=res, sum_out=sum_out, out_q8=out_q8)

        return both

    print(f"{fmt.name} {n} x {k} ({nbytes / 1e6:.1f} MB a matrix), {args.launches} launches, pdl {args.pdl}")
    variants = (("without the norm", plain), ("with the norm", with_norm), ("norm launch", norm_launch))
    for name, make in variants:
        seconds = _time([make(w) for w in weights], args.pdl == "on") / args.launches
        print(f"  {name:18} {seconds * 1e6:7.2f} us a product  {nbytes / seconds / 1e9:7.0f} GB/s")


if __name__ == "__main__":
    main()
