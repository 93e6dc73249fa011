"""Random model shapes, quantization mixes and knobs through the cuda lane's compile check, on a machine without
a GPU: a plan whose launch a kernel does not take, a tile Triton refuses, a binder that finds no kernel for a
format at a width, each shows up here as it would at a user's first prompt.

    python -m fuzz.lane_shapes [--seed N] [--count N] [--log FILE]

Each draw is a dense Qwen-like shape (qwen2 or qwen3: heads of 48 to 256 values, one to eight key heads, the
queries within half and twice the hidden width, hidden widths of whole 32-, 64- or 128-value units; some with
projections in the grid formats), a mixture of other widths (qwen2moe, qwen3moe; some with experts in the grid
formats), or Qwen3-Next or DeepSeek-V2-Lite cut to a few layers; a mix from `synth.Mix`, one knob setting or
none, and a batch of 2 to 5 sequences. Each runs
`python -m fuselane.lanes.cuda.compile_check` in a process of its own (it must not inherit the
interpreter's kernels); a line a draw goes to the log: OK, FAIL with the check's last line, or TIMEOUT.
About 10-20 s a draw on one core.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from fuselane.gguf.formats import GRID_FORMATS
from fuselane.gguf.synth import SHAPES, Mix, Shape, tensor_type_overrides, write_synthetic
from fuselane.gguf.synth_recipes import GRID_MIXES

KNOBS = (
    (), (), ("activations=dequant",), ("cache=f32",), ("prefill=f16-copy",), ("prefill=in-place",),
    ("rope_epilogue=on",), ("rope_epilogue=off",), ("norm_launch=off",), ("fuse_quant=off",), ("pdl=off",),
    ("weight_loads=ahead",), ("shared_fold=off",), ("chunk_rows=64",), ("round_in_place=on",),
    ("latent_decode=packed",),
)  # fmt: skip
HEAD_DIMS = (48, 64, 80, 96, 128, 128, 256)
UNITS = (32, 64, 128)  # a hidden width's unit
CUT = ("--layers", "2", "--experts", "16", "--vocab", "512")  # a named shape, cut
TIMEOUT_S = 600
# a dense or mixture draw's share whose projections are partly in the grid formats, and the projections it picks
# from (the gate and the up product together, so their pair is drawn too; a mixture's experts likewise)
GRID_DRAWS = 0.3
GRID_TARGETS = {
    "dense": ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_(gate|up)", "ffn_down"),
    "mixture": ("attn_q", "attn_output", "ffn_(gate|up)_exps", "ffn_down_exps"),
}


def _dense_or_mixture(rng: random.Random, mixture: bool) -> Shape | None:
    """A Qwen-like shape, or None where the draw's queries are not within half and twice its hidden width."""
    hd, kv = rng.choice(HEAD_DIMS), rng.choice((1, 2, 4, 8))
    heads = kv * rng.choice((1, 2, 3, 4, 6, 8))
    embd = rng.choice(UNITS) * rng.randint(4, 40)
    if not embd / 2 <= heads * hd <= 2 * embd:
        return None
    if not mixture:
        ff = 64 * rng.randint(embd // 32, embd // 64 * 6)
        return Shape(rng.choice(("qwen2", "qwen3")), embd, 2, heads, kv, hd, ff, 512, tied=rng.random() < 0.3)
    base = SHAPES[rng.choice(("qwen3-30b-a3b", "qwen1.5-moe-a2.7b"))]
    shared = 64 * rng.randint(4, 60) if base.shared_ff else 0
    return replace(base, n_embd=embd, n_layers=2, n_heads=heads, n_kv_heads=kv, head_dim=hd,
                   experts=rng.choice((8, 16)), experts_used=rng.choice((1, 2, 4)),
                   expert_ff=64 * rng.randint(2, 24), shared_ff=shared, vocab=512)  # fmt: skip


def _draw(rng: random.Random, folder: str, i: int) -> tuple[list[str], str] | None:
    """The compile check's arguments for one draw and a line that names it; None for a draw to skip."""
    kind = rng.choice(("dense", "dense", "dense", "mixture", "qwen3-next-80b-a3b", "deepseek-v2-lite"))
    # DeepSeek's per-head products in a grid format are refused by name (the cpu lane runs them): not a draw
    mixes = [m.value for m in Mix if not (kind == "deepseek-v2-lite" and m in GRID_MIXES)]
    mix, knobs, seqs = rng.choice(mixes), rng.choice(KNOBS), rng.choice((2, 2, 3, 5))
    tail = [*(a for k in knobs for a in ("--knob", k)), "--seqs", str(seqs)]
    said = f"mix={mix} knobs={','.join(knobs) or '-'} seqs={seqs}"
    if kind not in ("dense", "mixture"):
        layers = ("--layers", "4") if kind.startswith("qwen3-next") else ()
        return [kind, "--mix", mix, *CUT, *layers, *tail], f"{kind} {said}"
    shape = _dense_or_mixture(rng, kind == "mixture")
    if shape is None:
        return None
    types = _grid_types(rng, kind) if mix != Mix.MXFP4_MOE.value and rng.random() < GRID_DRAWS else []
    formats = tensor_type_overrides(shape, mix, types) if types else None
    path = write_synthetic(os.path.join(folder, f"{i}.gguf"), shape, mix, seed=1, formats=formats)
    return [str(path), *tail], f"{shape} {said}" + "".join(f" --tensor-type {t}" for t in types)


def _grid_types(rng: random.Random, kind: str) -> list[str]:
    """One to three of a dense or mixture layer's projections in a grid or ternary format, llama-quantize's way
    (`--tensor-type REGEX=TYPE`; a row not whole 256-value blocks takes llama.cpp's fallback)."""
    picked = rng.sample(GRID_TARGETS[kind], rng.randint(1, 3))
    return [f"{target}={rng.choice(sorted(f.name.lower() for f in GRID_FORMATS))}" for target in picked]


def _check(args: list[str]) -> tuple[str, str]:
    """OK, FAIL (with the check's last line) or TIMEOUT for one compile check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "fuselane.lanes.cuda.compile_check", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", ""
    if done.returncode == 0:
        return "OK", ""
    return "FAIL", (done.stderr.strip().splitlines() or ["(no output)"])[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz.lane_shapes", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=50, help="draws to check (default 50)")
    ap.add_argument("--log", default="-", help="where a line a draw goes (default: standard output)")
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    failed = 0
    with open(a.log, "a") if a.log != "-" else sys.stdout as log, tempfile.TemporaryDirectory() as folder:
        for i in range(a.count):
            drawn = _draw(rng, folder, i)
            if drawn is None:
                continue
            args, said = drawn
            started = time.monotonic()
            status, why = _check(args)
            failed += status != "OK"
            print(f"{status} {time.monotonic() - started:.0f}s {said} {why}".rstrip(), file=log, flush=True)
            if os.path.exists(args[0]):
                os.remove(args[0])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
