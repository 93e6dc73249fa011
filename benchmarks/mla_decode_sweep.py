"""Time the absorbed latent attention's decode kernel (`triton.mla.attention`) at DeepSeek's widths (kv_lora 512,
rope 64; V2-Lite's 16 heads, `--heads 16 128` adds V3's) at several depths, each launch replayed from a CUDA graph
so no host time counts. A row a depth: `split` is every span cut into the plan's shares and merged (the kernel
before the short path), `plan` what the lane launches on an H200 (the short path, `triton.mla.whole`, up to
`attn_kernels.MLA_SHORT_ROWS` rows, then the shares), `packed` the f16 tensor-core kernel `--knob latent_decode=packed`
takes (`triton.mla.packed`, its splits `packed.splits` at the cache's length; its difference from `split` is the
f16 operands', ~1e-3), and `whole:V/T/C/S/H` the short path forced at every depth
shown: `V` values a program, `T` rows a tile, `C` query values a product step, `S` stages of loads in flight, `H`
shares at most (past `attn_kernels.MLA_SHORT_SHARE_ROWS` rows). Where `plan` stops beating `split` is where
MLA_SHORT_ROWS belongs. The shares are `attn_kernels.mla_splits` at the cache's length (`--ctx`, each).

In brackets after each time, the variant's output against the first's (`split`): its largest difference over
the largest value (f32 sums in another order: ~1e-7). Each kernel variant compiles once a cache length (a few
seconds cold: 8 compiles by default); a failing one prints its error and the rest go on. The forced variants run
at the first `--ctx` only; a later one times its shallowest depth and those past half its length.

Usage: python benchmarks/mla_decode_sweep.py [--heads 16] [--ctx 4096 32768] [--depths 64 256 512 1024 4095 32767]
       (on a GPU)
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import replace

import torch

from benchmarks.gemv_compare import timed
from fuselane.lanes.cuda.plan import attn_kernels
from fuselane.lanes.cuda.triton.mla import attention as A
from fuselane.lanes.cuda.triton.mla import packed as P
from fuselane.lanes.cuda.triton.mla import whole

LORA, ROPE = 512, 64
FORCED = 1 << 20  # a short span longer than any cache here: the short path at every depth
# (values, tile rows, chunk, stages, shares) forced whole
WHOLE = [(128, 32, 128, 3, 1), (64, 32, 64, 3, 1), (256, 32, 128, 3, 4), (128, 64, 128, 2, 2)]
PLAN = replace(whole.PLAN, shares=2)  # the lane's on an H200 for V2-Lite's 16 heads (`mla_launch.short_path`)
WHOLE_UP_TO = 1024  # depths past this are the split path's: the forced short path is not timed there


def _launch(q, kc, pos, out, heads: int, shares: int, short: whole.Short):
    """One launch at these shares and short path, as a call (its scratch made once)."""
    work = A.scratch(1, heads, LORA, shares, q.device, short=short)
    return functools.partial(A.latent_attention, q, kc, kc[:, :LORA], pos, out, rows=1, heads=heads,
                             kw=LORA + ROPE, vd=LORA, scale=0.07, splits=shares, work=work, short=short)  # fmt: skip


def _packed(q, kc, pos, out, heads: int):
    """The packed kernel's launch at the plan's splits for the cache's length, as a call (its scratch made once)."""
    splits = P.splits(1, LORA, kc.shape[0], torch.cuda.get_device_properties(0).multi_processor_count)
    work = P.scratch(1, heads, LORA, splits, q.device) if splits > 1 else None
    return functools.partial(P.latent_attention, q, kc, pos, out, rows=1, heads=heads, kw=LORA + ROPE, vd=LORA,
                             scale=0.07, splits=splits, work=work)  # fmt: skip


def _variants(depth: int, forced: bool) -> list[tuple[str, whole.Short | None]]:
    """The kernels a depth is timed with: the split path alone, the plan's, the packed one (None), and (short
    depths of the first cache length: each variant is a compile at each length's shares) forced whole."""
    out = [("split", whole.NEVER), ("plan", PLAN), ("packed", None)]
    if forced and depth <= WHOLE_UP_TO:
        out += [(f"whole:{v}/{t}/{c}/{st}/{sh}", whole.Short(FORCED, v, t, c, st, sh)) for v, t, c, st, sh in WHOLE]
    return out


def _row(q, kc, out, heads: int, depth: int, shares: int, forced: bool) -> str:
    """One depth's times, each variant's output against the split path's (the largest difference relative to
    the largest value, in brackets: the compiled kernel checked where the tests run it interpreted), each
    variant's error in its place where it fails."""
    pos = torch.tensor([depth], dtype=torch.int32, device="cuda")
    said, first = [], None
    for name, short in _variants(depth, forced):
        if short is None and not P.takes(heads, LORA + ROPE, LORA):
            continue  # more heads than a packed program holds (V3's 128)
        try:
            call = _packed(q, kc, pos, out, heads) if short is None else _launch(q, kc, pos, out, heads, shares, short)
            took = timed(call)
            call()
            got = out.clone()
            first = got if first is None else first
            off = float((got - first).abs().max() / first.abs().max())
            said.append(f"{name} {took * 1e6:6.2f} ({off:.0e})")
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is reported, the rest go on
            said.append(f"{name} FAILED ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
    return "  ".join(said)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16])
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768], help="cache rows: the shares are fixed at it")
    ap.add_argument("--depths", type=int, nargs="+", default=[64, 256, 512, 1024, 4095, 32767])
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"short path: up to {attn_kernels.MLA_SHORT_ROWS} rows, {PLAN}", flush=True)
    began = time.perf_counter()
    for ctx in a.ctx:
        kc = torch.randn(ctx, LORA + ROPE, device="cuda").half()
        for heads in a.heads:
            q = torch.randn(1, heads * (LORA + ROPE), device="cuda")
            out = torch.empty(1, heads * LORA, device="cuda")
            shares = attn_kernels.mla_splits(A.groups(heads, LORA), ctx, sms)
            first = ctx == a.ctx[0]
            for depth in (d for d in a.depths if d < ctx and (first or d == min(a.depths) or d >= ctx // 2)):
                row = _row(q, kc, out, heads, depth, shares, first)
                print(f"heads {heads:3} ctx {ctx:5} ({shares} shares) depth {depth:5} us: {row}"
                      f"   [{time.perf_counter() - began:.0f} s]", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
