"""The gated delta rule's flat cost: decode tokens/s of a Qwen3-Next checkpoint whose layers are all gated
delta-rule layers, at depth 0 and deep in the context. Its state has a fixed size, so a step should cost the same
at any depth (the check: the deepest figure within 15 % of depth 0's).

Usage: python benchmarks/flat_cost.py OUT.gguf [--shape qwen3-next-80b-a3b] [--layers 4] [--experts 16]
       [--mix q4_k_m] [--depths 0 32768] [--prompt 512] [--gen 64] [--lane cuda]

The checkpoint keeps the shape's widths (its linear layers' key and value heads, its convolution, its experts' width)
with `--layers` layers, none of them full attention, and `--experts` of its experts; it is written once, where
missing. Prints each depth's `fuselane bench` result as JSON, then the ratio of the deepest decode to depth 0's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from fuselane.bench import bench_depths
from fuselane.gguf.synth import SHAPES, write_synthetic

FLAT_WITHIN = 0.15  # the issue's bound on the deepest decode's loss against depth 0's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3-next-80b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--mix", default="q4_k_m")
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 32768])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--lane", default="cuda")
    args = ap.parse_args()
    path = Path(args.out)
    if not path.exists():
        base = SHAPES[args.shape]
        experts = min(args.experts, base.experts) if base.experts else 0
        used = min(base.experts_used, experts)
        shape = replace(base, n_layers=args.layers, full_every=args.layers + 1, experts=experts, experts_used=used)
        write_synthetic(path, shape, args.mix, seed=3)
    results = bench_depths(str(path), lane=args.lane, prompt=args.prompt, generated=args.gen, depths=args.depths)
    for r in results:
        print(json.dumps(asdict(r)), flush=True)
    ratio = results[-1].decode_tok_s / results[0].decode_tok_s
    verdict = "flat" if ratio >= 1 - FLAT_WITHIN else "not flat"
    print(f"decode at depth {results[-1].depth}: {ratio:.3f} of depth {results[0].depth}'s ({verdict})")


if __name__ == "__main__":
    main()
