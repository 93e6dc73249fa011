"""Time the absorbed latent attention's decode kernel (`triton.mla.attention`) at DeepSeek's widths (kv_lora 512,
rope 64; V2-Lite's 16 heads, V3's 128) at several depths, heads a program, value slices, warps and shares, each
launch replayed from a CUDA graph so no host time counts. `plan` is the shares `kernels.mla_splits` gives at the
cache's length, what the lane launches.

Usage: python benchmarks/mla_decode_sweep.py [--heads 16 128] [--depths 64 4096] [--ctx 4096]   (on a GPU)
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.gemv_compare import timed
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.triton.mla import attention as A

LORA, ROPE = 512, 64
BLOCKS = [  # (heads a program, value slices, warps): the plan's first
    (kernels.MLA_HEADS_A_PROGRAM, kernels.MLA_VALUE_SLICES, kernels.MLA_WARPS),
    (4, 1, 2),
    (16, 1, 8),
    (8, 2, 4),
    (16, 4, 4),
]
SPLITS = [None, 4, 16, 64]  # None: the plan's


def _time(q, kc, pos, out, heads: int, hb: int, slices: int, warps: int, shares: int) -> float:
    """Seconds one launch takes at these blocks and shares."""
    tiles = dict(heads_a_program=hb, value_slices=slices, warps=warps)
    work = A.scratch(1, heads, LORA, shares, q.device, value_slices=slices, heads_a_program=hb)
    call = functools.partial(A.latent_attention, q, kc, kc[:, :LORA], pos, out, rows=1, heads=heads,
                             kw=LORA + ROPE, vd=LORA, scale=0.07, splits=shares, work=work, **tiles)  # fmt: skip
    return timed(call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--depths", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--ctx", type=int, default=4096, help="cache rows: the plan's shares are fixed at it")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kc = torch.randn(a.ctx, LORA + ROPE, device="cuda").half()
    for heads in a.heads:
        q = torch.randn(1, heads * (LORA + ROPE), device="cuda")
        out = torch.empty(1, heads * LORA, device="cuda")
        for depth in (d for d in a.depths if d < a.ctx):
            pos = torch.tensor([depth], dtype=torch.int32, device="cuda")
            row = []
            for hb, slices, warps in BLOCKS:
                plan = kernels.mla_splits(A.groups(heads, LORA, slices, hb), a.ctx, sms)
                for s in SPLITS:
                    took = _time(q, kc, pos, out, heads, hb, slices, warps, plan if s is None else s)
                    row.append(f"{hb}h/{slices}v/{warps}w/{'plan ' + str(plan) if s is None else s}:{took * 1e6:6.1f}")
            print(f"heads {heads:3} depth {depth:5} ctx {a.ctx} us: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
