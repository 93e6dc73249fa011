"""Time the decode attention (FlashDecode) on the reference shapes' heads at several spans, heads a block and
splits, each launch replayed from a CUDA graph so no host time counts.

Usage: python benchmarks/attn_decode_sweep.py [--spans 64 512 4096] [--shapes 7b 8b]   (on a GPU)
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.gemv_compare import timed
from fuselane.lanes.cuda.triton.attention import decode as A

HEADS = [  # (name, heads, kv_heads, head dim)
    ("0.5b", 14, 2, 64),
    ("0.6b", 16, 8, 128),
    ("7b", 28, 4, 128),
    ("8b", 32, 8, 128),
    ("next", 16, 2, 256),  # Qwen3-Next-80B-A3B's full-attention layers
]
CACHE = 8192
SPANS = [64, 512, 4096]
SPLITS = [None, 4, 16, 64, 128]
TILES = [8, 16, 32]
MIN_CHUNKS = [32, 128]  # beside the plan's kernels.ATTN_MIN_CHUNK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spans", type=int, nargs="+", default=SPANS)
    ap.add_argument("--shapes", nargs="+", default=[h[0] for h in HEADS], choices=[h[0] for h in HEADS])
    args = ap.parse_args()
    for name, heads, kv, hd in HEADS:
        if name not in args.shapes:
            continue
        q = torch.randn(1, heads * hd, device="cuda")
        kc = torch.randn(CACHE, kv * hd, device="cuda").half()
        vc = torch.randn(CACHE, kv * hd, device="cuda").half()
        out = torch.empty(1, heads * hd, device="cuda")
        group = heads // kv
        # the most splits: the plan's at the fewest blocks (a whole group a block), or the largest asked
        most = max(*(s or 0 for s in SPLITS), A.decode_plan(heads, kv, hd, CACHE, heads_per_block=group).splits)
        scratch = A.decode_scratch(heads, hd, CACHE, "cuda", splits=most)
        blocks = sorted({h for h in (1, 2, group) if group % h == 0})
        for span in args.spans:
            pos = torch.tensor([span - 1], dtype=torch.int32, device="cuda")
            call = functools.partial(A.flash_decode, q, kc, vc, pos, out, heads=heads, kv_heads=kv, hd=hd,
                                     scale=hd**-0.5, scratch=scratch)  # fmt: skip
            row = []
            for hb in blocks:
                for s in SPLITS:
                    took = timed(functools.partial(call, splits=s, heads_per_block=hb))
                    row.append(f"{hb}h/{'plan' if s is None else s}:{took * 1e6:5.1f}")
                for t in TILES:
                    took = timed(functools.partial(call, heads_per_block=hb, tile_rows=t))
                    row.append(f"{hb}h/t{t}:{took * 1e6:5.1f}")
                for c in MIN_CHUNKS:
                    took = timed(functools.partial(call, heads_per_block=hb, min_chunk=c))
                    row.append(f"{hb}h/c{c}:{took * 1e6:5.1f}")
            plan = tuple(A.decode_plan(heads, kv, hd, CACHE))
            print(f"{name:5} span {span:5} plan {plan} us: " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
