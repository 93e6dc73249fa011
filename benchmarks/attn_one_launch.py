"""One decode attention launch after a few warm ones, at a reference shape's heads: something for Nsight Compute
to profile (a graph replay hides the kernels from it), e.g.

    ncu --clock-control none --kernel-name regex:_group_decode --launch-skip 5 --launch-count 1 --set full \
        python benchmarks/attn_one_launch.py --shape 7b --span 4096

The launches read one of `COPIES` caches each in turn, as `attn_decode_sweep.py`'s do, so the profiled one reads
its rows from memory. `--splits` overrides the plan's; `--cores` takes the CUDA-core kernel (the dequantized
numerics') instead of the packed one.

Usage: python benchmarks/attn_one_launch.py [--shape 7b] [--span 4096] [--splits N] [--cores]   (on a GPU)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.attn_decode_sweep import HEADS
from fuselane.lanes.cuda.triton.attention import decode as A

COPIES = 12
LAUNCHES = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="7b", choices=[h[0] for h in HEADS])
    ap.add_argument("--span", type=int, default=4096, help="cached rows the launch reads")
    ap.add_argument("--splits", type=int, default=None)
    ap.add_argument("--cores", action="store_true", help="the CUDA-core kernel, not the packed one")
    args = ap.parse_args()
    _, heads, kv, hd = next(h for h in HEADS if h[0] == args.shape)
    caches = [
        (torch.randn(args.span, kv * hd, device="cuda").half(), torch.randn(args.span, kv * hd, device="cuda").half())
        for _ in range(COPIES)
    ]
    scratches = [A.decode_scratch(heads, hd, args.span, "cuda") for _ in range(COPIES)]
    q, out = torch.randn(1, heads * hd, device="cuda"), torch.empty(1, heads * hd, device="cuda")
    pos = torch.tensor([args.span - 1], dtype=torch.int32, device="cuda")
    for i in range(LAUNCHES):
        kc, vc = caches[i % COPIES]
        A.flash_decode(q, kc, vc, pos, out, heads=heads, kv_heads=kv, hd=hd, scale=hd**-0.5,
                       scratch=scratches[i % COPIES], splits=args.splits, f16_ops=not args.cores)  # fmt: skip
    torch.cuda.synchronize()
    print(f"{args.shape} at {args.span} rows: {LAUNCHES} launches, |out| sum {out.abs().sum().item():.3f}")


if __name__ == "__main__":
    main()
