"""The absorbed latent attention's decode kernel (`triton.mla.attention`) as compiled for an H200 (sm_90a),
without a GPU: registers a thread, stack bytes a thread (spills) and the SASS instructions that do its work,
at DeepSeek-V2-Lite's widths (16 heads) and V3's (128 heads), kv_lora 512 and rope 64, the cache in f16, as a
launch specializes it (16-aligned pointers and pitches), for one share and for a split span (its merge).

`--old COMMIT` compiles the kernel as that commit had it (one program a query row's heads, one 576-wide
product a tile) beside the current one: its source is read from the repository with git.

The short-span path (`triton.mla.whole`, `--short-rows` above 0, the plan's by default) is compiled into the same
kernel: its registers are the kernel's, and `--short-rows 0` compiles the split path alone.

Usage: python benchmarks/mla_registers.py [--old 49158d3] [--heads 16,128] [--splits 1,4] [--heads-a-program 8]
       [--value-slices 1] [--score-chunk 32] [--warps 4] [--merge-batch 4] [--short-rows 1024]
       [--short-values 64] [--short-tile-rows 32] [--short-chunk 64]
       [--short-stages 3] [--short-shares 2]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fuselane.lanes.cuda.compile_check import cuobjdump, resources
from fuselane.lanes.cuda.plan import attn_kernels
from fuselane.lanes.cuda.triton.mla import attention, whole

SM90 = GPUTarget("cuda", 90, 32)
LORA, ROPE = 512, 64
ARGS = {  # the kernel's runtime arguments and their types (an f32 query, the cache in f16)
    **dict(q="*fp32", kc="*fp16", vc="*fp16", pos="*i32", out="*fp32", part="*fp32", counter="*i32"),
    **dict(spart="*fp32", scount="*i32"),
    **dict(k_pitch="i32", v_pitch="i32", scale="fp32"),
}
ALIGNED = [["tt.divisibility", 16]]
SHORT_CONSTS = ("SHORT_ROWS", "VS", "BN_S", "KC_S", "STAGES_S", "SHARES_S", "SHARE_ROWS")  # the kernel's order
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")  # an opcode, past its predicate
COUNTED = ("FFMA", "LDS", "LDG", "LDGSTS", "STS", "SHFL", "BAR", "LDL", "STL")  # SASS opcodes, any width


def _compile(kernel, consts: dict, warps: int):
    sig = {a: "constexpr" if a in consts else ARGS[a] for a in kernel.arg_names}
    attrs = {(i,): ALIGNED for i, a in enumerate(kernel.arg_names) if a not in consts and a != "scale"}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=SM90, options=dict(num_warps=warps))


def sass(cubin: bytes) -> dict[str, int]:
    """Each counted opcode's instructions in the kernel's SASS (the whole kernel: a tile's loop body once,
    with what the pipeliner peels around it)."""
    said = cuobjdump(cubin, "-sass")
    ops = collections.Counter(op.split(".")[0] for op in OPCODE.findall(said))
    return {name: ops[name] for name in COUNTED}


def current(heads: int, splits: int, a: argparse.Namespace):
    """The kernel as this tree has it, at its plan's blocks or those asked."""
    hb, vb, g = attention.blocks(heads, LORA, a.heads_a_program, a.value_slices)
    cluster, count, slots = attention.clusters(splits)
    consts = dict(HEADS=heads, KW=LORA + ROPE, VD=LORA, HB=hb, VB=vb, SLICES=a.value_slices, GROUPS=g,
                  KC=a.score_chunk, BLOCK_N=attn_kernels.MLA_TILE_ROWS, SPLITS=splits, CLUSTER=cluster, CLUSTERS=count,
                  SLOTS=slots, MERGE_BATCH=a.merge_batch,
                  **dict(zip(SHORT_CONSTS, short(a).constants(), strict=True)),
                  INTERPRETED=False, SEQ_ROWS=0, PDL=True)  # fmt: skip
    return _compile(attention._latent_attention_kernel, consts, a.warps)


def short(a: argparse.Namespace) -> whole.Short:
    """The short-span path as asked."""
    return whole.Short(a.short_rows, a.short_values, a.short_tile_rows, a.short_chunk, a.short_stages, a.short_shares)


def old(module, heads: int, splits: int):
    """The kernel as `--old` had it: a program a row's heads (at least 16), the whole width of each."""
    p2 = module._p2
    consts = dict(HEADS=heads, LORA=LORA, ROPE=ROPE, VD=LORA, H_P2=p2(heads), L_P2=p2(LORA), R_P2=p2(ROPE),
                  V_P2=p2(LORA), BLOCK_N=module.BLOCK_N, SPLITS=splits, INTERPRETED=False, SEQ_ROWS=0,
                  PDL=True)  # fmt: skip
    return _compile(module._latent_attention_kernel, consts, module.WARPS)


def load_old(commit: str, folder: str):
    """The module `triton/mla/attention.py` as of `commit`, imported from a copy in `folder`."""
    rel = "src/fuselane/lanes/cuda/triton/mla/attention.py"
    text = subprocess.run(["git", "show", f"{commit}:{rel}"], capture_output=True, text=True, check=True).stdout
    path = os.path.join(folder, "mla_attention_old.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("mla_attention_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _line(label: str, heads: int, splits: int, done) -> str:
    regs, stack = resources(done.asm["cubin"])
    counts = "  ".join(f"{k} {v}" for k, v in sass(done.asm["cubin"]).items())
    return f"{label:4s} heads {heads:3d} splits {splits}: {regs:3d} registers {stack:6d} stack bytes  | {counts}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="", help="a commit whose kernel to compile beside this one (e.g. 49158d3)")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--splits", default="1,4")
    ap.add_argument("--heads-a-program", type=int, default=attn_kernels.MLA_HEADS_A_PROGRAM)
    ap.add_argument("--value-slices", type=int, default=attn_kernels.MLA_VALUE_SLICES)
    ap.add_argument("--score-chunk", type=int, default=attn_kernels.MLA_SCORE_CHUNK)
    ap.add_argument("--warps", type=int, default=attn_kernels.MLA_WARPS)
    ap.add_argument("--merge-batch", type=int, default=attn_kernels.MLA_MERGE_BATCH)
    plan = whole.Short()
    ap.add_argument("--short-rows", type=int, default=plan.rows)
    ap.add_argument("--short-values", type=int, default=plan.values)
    ap.add_argument("--short-tile-rows", type=int, default=plan.tile_rows)
    ap.add_argument("--short-chunk", type=int, default=plan.chunk)
    ap.add_argument("--short-stages", type=int, default=plan.stages)
    ap.add_argument(
        "--short-shares", type=int, default=2, help="the short path's shares at most (V2-Lite's on an H200)"
    )
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        before = load_old(a.old, folder) if a.old else None
        for heads in (int(h) for h in a.heads.split(",")):
            for splits in (int(s) for s in a.splits.split(",")):
                if before is not None:
                    print(_line("old", heads, splits, old(before, heads, splits)), flush=True)
                print(_line("new", heads, splits, current(heads, splits, a)), flush=True)


if __name__ == "__main__":
    main()
