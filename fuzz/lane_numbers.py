"""Random tiny models, quantization mixes and knobs through the whole cuda lane under Triton's interpreter,
against the cpu lane in f64: a kernel that computes the wrong numbers at a width, a group or a mix no test
names shows up here as a step outside the lane's numerics contract (or not finite).

    python -m fuzz.lane_numbers [--seed N] [--count N] [--log FILE]

`fuzz.lane_shapes` compiles the launches of real widths; this runs tiny widths' launches and checks their
numbers. Each draw is a dense Qwen-like model (qwen2 or qwen3: heads of 8 to 96 values, one to four key
heads, one to four query heads each, one or two layers, tied or not), a tiny mixture (qwen2moe with a shared
expert, qwen3moe; four or eight experts, one or two kept), a tiny Qwen3-Next (a linear and a full-attention
layer, delta-rule heads of 16 or 32 values) or a tiny DeepSeek (V2's routing or V3's ungrouped, none to two
shared experts, value heads of 16 or 32), a mix from `synth.Mix`, and one knob setting or none. A prompt past the GEMV's
rows, a short chunk and two decode steps run on both lanes (`tests.lane_steps.runs_as_the_cpu_lane`); a line
a draw goes to the log: OK, FAIL with the first step out of the contract, or the error. 5-100 s a draw on one
core.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import replace

from fuselane.gguf.formats import QK  # a quantized row's block: a model's rows are whole blocks
from fuselane.gguf.synth import SHAPES, Mix, Shape, write_synthetic
from fuselane.gguf.synth_latent import LatentShape
from fuselane.gguf.synth_recipes import GRID_MIXES

KNOBS = (
    (), (), (), ("activations=dequant",), ("rope_epilogue=on",), ("prefill=in-place",), ("prefill=int8",),
    ("norm_launch=off",), ("fuse_quant=off",), ("cache=f32",), ("shared_fold=off",), ("latent_decode=packed",),
)  # fmt: skip
HEAD_DIMS = (8, 16, 32, 48, 64, 80, 96)
PROMPT = [5, 60, 7, 300, 8, 1, 2, 3, 4, 5, 6]  # past the GEMV's rows: the prefill's products and attention
SHORT, DECODE = [12, 13], [9, 4]
CTX = 32


def _latent(rng: random.Random) -> LatentShape:
    """A tiny DeepSeek: V2's routing or V3's ungrouped (sigmoid scores, weights renormalised and scaled), a
    dense first layer, then a mixture with none to two shared experts (added ungated)."""
    # the lane routes by one top-k, and its products take rows of whole 32-value blocks (the tiny V3's q LoRA is 48)
    v3 = replace(SHAPES["tiny-deepseek3"], groups=1, groups_used=1, q_lora=2 * QK)
    base = SHAPES["tiny-deepseek2"] if rng.random() < 0.5 else v3
    # values a head of 32: the value half writes the int8 form `attn_output` reads in its own programs
    return replace(base, n_heads=rng.choice((2, 4, 8)), experts=rng.choice((4, 8)), experts_used=rng.choice((1, 2)),
                   expert_ff=QK * rng.randint(1, 3), shared_experts=rng.choice((0, 1, 2)), vocab=512,
                   vdim=rng.choice((16, QK)))  # fmt: skip


def _hybrid(rng: random.Random) -> Shape:
    """A tiny Qwen3-Next: a linear and a full-attention layer, the delta rule's heads 16 or 32 values wide (32:
    normed in the convolution's epilogue) in groups of one or two value heads a key head."""
    k_heads, dim = rng.choice((1, 2)), rng.choice((16, QK))
    return replace(SHAPES["tiny-qwen3next"], n_layers=2, ssm_k_heads=k_heads, ssm_v_heads=k_heads * rng.choice((2, 4)),
                   ssm_dim=dim, experts=rng.choice((4, 8)), experts_used=rng.choice((1, 2)))  # fmt: skip


def _draw(rng: random.Random) -> Shape | LatentShape | None:
    """A tiny dense, mixture, Qwen3-Next or DeepSeek shape, or None where its query or hidden width is not whole
    32-value blocks."""
    family = rng.random()
    if family < 0.15:
        return _latent(rng)
    if family < 0.25:
        return _hybrid(rng)
    hd, kv = rng.choice(HEAD_DIMS), rng.choice((1, 2, 4))
    heads = kv * rng.choice((1, 2, 3, 4))
    embd = QK * rng.randint(2, 10)
    if heads * hd % QK:
        return None
    if rng.random() < 2 / 3:
        arch, ff = rng.choice(("qwen2", "qwen3")), QK * rng.randint(2, 12)
        return Shape(arch, embd, rng.choice((1, 2)), heads, kv, hd, ff, 512, context=4096, tied=rng.random() < 0.3)
    base = SHAPES[rng.choice(("tiny-qwen3moe", "tiny-qwen2moe"))]
    shared = QK * rng.randint(1, 6) if base.shared_ff else 0
    return replace(base, n_embd=embd, n_layers=1, n_heads=heads, n_kv_heads=kv, head_dim=hd, vocab=512,
                   experts=rng.choice((4, 8)), experts_used=rng.choice((1, 2)), expert_ff=QK * rng.randint(1, 4),
                   shared_ff=shared)  # fmt: skip


def said(shape: Shape | LatentShape) -> str:
    """A draw's shape in a few words: arch, hidden width, layers, heads (query/key x width), FFN, experts."""
    if isinstance(shape, LatentShape):
        routing = "sigmoid" if shape.sigmoid else "softmax"
        experts = f"experts={shape.experts}/{shape.experts_used}x{shape.expert_ff} shared={shape.shared_experts}"
        heads = f"h={shape.n_heads}x{shape.vdim}"
        return f"{shape.arch} d={shape.n_embd} L={shape.n_layers} {heads} {routing} {experts}"
    out = f"{shape.arch} d={shape.n_embd} L={shape.n_layers} h={shape.n_heads}/{shape.n_kv_heads}x{shape.head_dim}"
    out += f" ff={shape.n_ff}" + (" tied" if shape.tied else "")
    if shape.ssm_dim:
        out += f" delta={shape.ssm_v_heads}/{shape.ssm_k_heads}x{shape.ssm_dim}"
    if shape.experts:
        out += f" experts={shape.experts}/{shape.experts_used}x{shape.expert_ff} shared={shape.shared_ff}"
    return out


def _run(path: str, knobs: tuple[str, ...]) -> tuple[str, str]:
    """OK, or FAIL with why: a step out of the contract, or the error a lane raised."""
    from tests.lane_steps import runs_as_the_cpu_lane

    try:
        runs_as_the_cpu_lane(path, PROMPT, SHORT, DECODE, ctx=CTX, knobs=list(knobs))
    except AssertionError as e:
        return "FAIL", str(e)
    except Exception as e:  # a lane's error is a finding too: report it and go on
        where = traceback.extract_tb(e.__traceback__)[-1]
        return "FAIL", f"{type(e).__name__}: {' '.join(str(e).split())[:300]} ({where.filename}:{where.lineno})"
    return "OK", ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz.lane_numbers", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=20, help="draws to run (default 20)")
    ap.add_argument("--log", default="-", help="where a line a draw goes (default: standard output)")
    a = ap.parse_args(argv)
    # before Triton is first imported (the lanes load it lazily): without a GPU every launch runs on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        from fuselane.lanes.cuda.triton import interpreter_calls

        interpreter_calls.install()
    rng = random.Random(a.seed)
    failed = 0
    with open(a.log, "a") if a.log != "-" else sys.stdout as log, tempfile.TemporaryDirectory() as folder:
        for i in range(a.count):
            shape = _draw(rng)
            # DeepSeek's per-head products in a grid format are refused by name (the cpu lane runs them)
            latent = isinstance(shape, LatentShape)
            mix = rng.choice([m.value for m in Mix if not (latent and m in GRID_MIXES)])
            knobs = rng.choice(KNOBS)
            if shape is None:
                continue
            path = str(write_synthetic(os.path.join(folder, f"{i}.gguf"), shape, mix, seed=i))
            started = time.monotonic()
            status, why = _run(path, knobs)
            failed += status != "OK"
            line = f"{status} {time.monotonic() - started:.0f}s {said(shape)} mix={mix} knobs={','.join(knobs) or '-'}"
            print(f"{line} {why}".rstrip(), file=log, flush=True)
            os.remove(path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
