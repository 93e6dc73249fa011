"""Time the decode attention (FlashDecode) on the reference shapes' heads at several spans: the head-a-block
kernel on the CUDA cores (`attention/decode.py`) and the packed one on the f16 tensor cores
(`attention/group_decode.py`), by splits and tile rows, each launch replayed from a CUDA graph so no host time
counts.

A step reads a layer's cache once, cold (the layer's weights went through L2 since): the launches replayed here
read one of `COPIES` caches each in turn, together past the H200's 50 MB L2, so a launch's rows come from
memory as in a step. Each line also gives the packed kernel's largest difference from the head-a-block one.

With `--seams`, heads that are not whole 32-value blocks (48, 80 values) writing their int8 form: a head a
block sharing its seams through counters (the plan's), two heads a block (whole blocks together, an even
group), and a head a block without the int8 form followed by a `Quantize` launch (what an odd group took
before the seams), each a launch (or two) replayed as above.

Usage: python benchmarks/attn_decode_sweep.py [--spans 64 512 4096] [--shapes 7b 8b] [--seams]   (on a GPU)
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from benchmarks.gemv_compare import timed_in_turn
from fuselane.lanes.cuda.triton.attention import decode as A
from fuselane.lanes.cuda.triton.attention import group_decode as G

HEADS = [  # (name, heads, kv_heads, head dim)
    ("0.5b", 14, 2, 64),
    ("0.6b", 16, 8, 128),
    ("7b", 28, 4, 128),
    ("8b", 32, 8, 128),
    ("32b", 40, 8, 128),
    ("next", 16, 2, 256),  # Qwen3-Next-80B-A3B's full-attention layers
]
SPANS = [64, 512, 4096]
SPLITS = [None, 16, 32]
TILES = [64]
WARPS = [None, 4, 8]
STAGES = [2]
# (name, heads, kv_heads, head dim): heads not whole 32-value blocks, in even groups so two heads a block are
SEAM_HEADS = [("h80", 32, 8, 80), ("h48", 32, 8, 48)]
COPIES = 12  # caches a graph cycles through: 12 x 8.4 MB at the 7B's 4,096 rows
REPS = 24


def timed(calls) -> float:
    """Seconds a launch takes: `calls` (one a cache copy) replayed in turn from one CUDA graph."""
    return timed_in_turn(calls, REPS)


def launches(case, pos, out, **kw):
    """One launch a cache copy of `case` (heads, kv heads, head dim, the copies, their scratches), the scratches
    zeroed: a launch of other splits finds its counters where another left partials."""
    heads, kv, hd, q, kvs, scratches = case
    for s in scratches:
        s.zero_()
    return [
        functools.partial(
            A.flash_decode, q, kc, vc, pos, out, heads=heads, kv_heads=kv, hd=hd, scale=hd**-0.5, scratch=s, **kw
        )  # fmt: skip
        for (kc, vc), s in zip(kvs, scratches, strict=True)
    ]


def _case(heads: int, kv: int, hd: int, cache: int):
    kvs = [
        (torch.randn(cache, kv * hd, device="cuda").half(), torch.randn(cache, kv * hd, device="cuda").half())
        for _ in range(COPIES)
    ]
    scratches = [A.decode_scratch(heads, hd, cache, "cuda") for _ in range(COPIES)]
    return (heads, kv, hd, torch.randn(1, heads * hd, device="cuda"), kvs, scratches)


def _then_quantize(call, out, q8) -> None:
    from fuselane.lanes.cuda.triton import quant

    call()
    quant.quantize(out, q8)


def seams(spans: list[int]) -> None:
    """A head a block with its seams' counters, two heads a block, and a head a block then a `Quantize`."""
    from fuselane.lanes.cuda.triton import quant

    cache = max(spans)
    for name, heads, kv, hd in SEAM_HEADS:
        case = _case(heads, kv, hd, cache)
        out, q8 = torch.empty(1, heads * hd, device="cuda"), quant.empty_q8(1, heads * hd, "cuda")
        for span in spans:
            pos = torch.tensor([span - 1], dtype=torch.int32, device="cuda")
            one = timed(launches(case, pos, out, out_q8=q8, heads_per_block=1))
            two = timed(launches(case, pos, out, out_q8=q8, heads_per_block=2))
            apart = [functools.partial(_then_quantize, c, out, q8) for c in launches(case, pos, out, heads_per_block=1)]
            print(f"{name:4} span {span:5} us: seams {one * 1e6:5.1f}  two heads a block {two * 1e6:5.1f}  "
                  f"then a Quantize {timed(apart) * 1e6:5.1f}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spans", type=int, nargs="+", default=SPANS)
    ap.add_argument("--shapes", nargs="+", default=[h[0] for h in HEADS], choices=[h[0] for h in HEADS])
    ap.add_argument("--seams", action="store_true", help="heads of 48 and 80 values writing their int8 form")
    args = ap.parse_args()
    if args.seams:
        seams(args.spans)
        return
    cache = max(args.spans)
    for name, heads, kv, hd in HEADS:
        if name not in args.shapes:
            continue
        case = _case(heads, kv, hd, cache)
        outs = [torch.empty(1, heads * hd, device="cuda") for _ in range(2)]
        for span in args.spans:
            pos = torch.tensor([span - 1], dtype=torch.int32, device="cuda")
            row = [f"cores:{timed(launches(case, pos, outs[0])) * 1e6:5.1f}"]
            for s, t, w, st in itertools.product(SPLITS, TILES, WARPS, STAGES):
                if t * hd > 128 * 128 and st > 2:  # past the shared memory
                    continue
                took = timed(launches(case, pos, outs[0], f16_ops=True, splits=s, tile_rows=t, warps=w, stages=st))
                row.append(f"{'plan' if s is None else s}/t{t}w{w or 'plan'}s{st}:{took * 1e6:5.1f}")
            launches(case, pos, outs[0])[0]()
            launches(case, pos, outs[1], f16_ops=True)[0]()
            diff = (outs[0] - outs[1]).abs().max().item()
            plan = tuple(G.group_plan(heads, kv, cache, 132))
            print(f"{name:5} span {span:5} plan {plan} diff {diff:.1e} us: " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
