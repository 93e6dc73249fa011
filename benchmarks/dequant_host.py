"""Host dequantization speed, fuselane's decoders against `gguf.quants`, in millions of values a second.

Usage: python benchmarks/dequant_host.py [--mb 8] [--formats IQ2_XXS IQ3_S ...]
Each format decodes `--mb` MiB of random blocks (`quantize.random_blocks`) whole, best of three runs each, and
checks that both give the same bits. The cpu lane dequantizes every matrix once at load, so this is most of a
model's load time there.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType

from fuselane.gguf.dequant import dequantize
from fuselane.gguf.formats import LAYOUTS, FieldKind, Format
from fuselane.gguf.quantize import random_blocks

RUNS = 3


def _best(fn, *args) -> float:
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=8, help="MiB of blocks a format")
    ap.add_argument("--formats", nargs="*", help="format names (default: every quantized format)")
    args = ap.parse_args()
    quantized = [f for f in Format if LAYOUTS[f].fields[0].kind is not FieldKind.VALUES]
    formats = [Format[name.upper()] for name in args.formats] if args.formats else quantized
    rng = np.random.default_rng(0)
    print("| format | fuselane M values/s | gguf.quants M values/s | ratio |")
    print("|---|---:|---:|---:|")
    for fmt in formats:
        lay = LAYOUTS[fmt]
        n = (args.mb << 20) // lay.nbytes
        blocks = random_blocks(fmt, n, rng)
        values = n * lay.values
        qtype = GGMLQuantizationType(int(fmt))
        ours = dequantize(blocks.reshape(-1), fmt, (values,))
        ref = np.asarray(gguf_quants.dequantize(blocks, qtype), np.float32).reshape(-1)
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), fmt.name
        t_ours = _best(dequantize, blocks.reshape(-1), fmt, (values,))
        t_gguf = _best(gguf_quants.dequantize, blocks, qtype)
        print(f"| {fmt.name} | {values / t_ours / 1e6:,.0f} | {values / t_gguf / 1e6:,.0f} | {t_gguf / t_ours:.1f}x |")


if __name__ == "__main__":
    main()
