"""Time the decode attention (FlashDecode) on the reference shapes' heads at several spans and splits, each
launch replayed from a CUDA graph so no host time counts.

Usage: python benchmarks/attn_decode_sweep.py   (on a GPU)
"""

from __future__ import annotations

import torch

from benchmarks.gemv_compare import timed
from fuselane.lanes.cuda.triton import attention as A

HEADS = [  # (name, heads, kv_heads, head dim)
    ("0.5b", 14, 2, 64),
    ("0.6b", 16, 8, 128),
    ("7b", 28, 4, 128),
    ("8b", 32, 8, 128),
]
CACHE = 8192
SPANS = [64, 512, 4096]
SPLITS = [None, 1, 8, 16, 32, 64]


def main() -> None:
    for name, heads, kv, hd in HEADS:
        q = torch.randn(1, heads * hd, device="cuda")
        kc = torch.randn(CACHE, kv * hd, device="cuda").half()
        vc = torch.randn(CACHE, kv * hd, device="cuda").half()
        out = torch.empty(1, heads * hd, device="cuda")
        scratch = A.decode_scratch(heads, hd, CACHE, "cuda", splits=128)
        for span in SPANS:
            pos = torch.tensor([span - 1], dtype=torch.int32, device="cuda")
            row = []
            shape = dict(heads=heads, kv_heads=kv, hd=hd, scale=hd**-0.5, scratch=scratch)
            for s in SPLITS:
                args = (q, kc, vc, pos, out)
                took = timed(lambda a=args, k=shape, s=s: A.flash_decode(*a, **k, splits=s))
                row.append(f"{'plan' if s is None else s}:{took * 1e6:6.1f}")
            plan = A.decode_plan(heads, kv, hd, CACHE)
            print(f"{name:5} span {span:5} plan {tuple(plan)}  us: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
