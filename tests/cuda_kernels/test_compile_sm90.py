"""Every launch of a model's steps on the cuda lane compiles for an H200 (sm_90), checked on a host without a GPU
(`fuselane.lanes.cuda.compile_check`): Triton's interpreter, which the other kernel tests run under, takes code its
compiler refuses (a global that is not a constexpr, a layout the backend cannot lower), so this compiles each
launch as the lane makes it, through PTX to a cubin. Each architecture's steps in the mix the GPU benchmarks use,
and the knobs that switch a chunk's products to other kernels. A subprocess each: the check needs kernels that
were never decorated under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from fuselane.gguf.synth import SHAPES, Shape, write_synthetic

pytest.importorskip("torch")
pytest.importorskip("triton")

TIMEOUT = 600  # seconds: a cold compile of every kernel of a tiny model takes seconds to a minute

CASES = [
    ("tiny-qwen3", "q4_k_m", []),
    ("tiny-qwen2", "q8_0", ["activations=dequant"]),
    ("tiny-qwen2", "q8_0", ["round_in_place=on"]),  # a chunk's dying activations rounded in their own bytes
    ("tiny-qwen2moe", "q4_k_m", ["prefill=int8"]),
    ("tiny-qwen3moe", "q8_0", ["prefill=in-place"]),
    ("tiny-qwen3moe", "mxfp4_moe", []),  # MXFP4 experts through IQ4_NL's bodies with its table and scale
    ("tiny-qwen3next", "q4_k_m", []),
    ("tiny-deepseek2", "q4_k_m", []),
]
# The real widths, a layer or two, a small vocabulary and, for the hybrid, 16 of its 512 experts (a layer's kernels
# and tiles are its widths', not its counts): the shapes of ANCHORS.md and the mixtures', hybrid's and latent
# attention's published ones. Qwen3-Next takes four layers: its fourth is full attention.
REAL = [
    ("qwen2.5-7b", "q4_k_m", ["--layers", "1"]),
    ("qwen3-0.6b", "q8_0", ["--layers", "1"]),
    ("qwen3-30b-a3b", "q4_k_m", ["--layers", "1"]),
    ("deepseek-v2-lite", "q4_k_m", ["--layers", "2"]),
    ("qwen3-next-80b-a3b", "q4_k_m", ["--layers", "4", "--experts", "16"]),
    # llama.cpp's Q2_K recipe: the shared expert's down in Q3_K, an int8 product after its gate/up's int8 tiles
    ("qwen3-next-80b-a3b", "q2_k", ["--layers", "4", "--experts", "16"]),
]
SMALL_VOCAB = "2048"


@pytest.mark.parametrize(("shape", "mix", "knobs"), CASES, ids=[f"{s}-{m}-{'-'.join(k)}" for s, m, k in CASES])
def test_every_launch_compiles_for_sm90(shape, mix, knobs):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-m", "fuselane.lanes.cuda.compile_check", shape, "--mix", mix]
    argv += [a for k in knobs for a in ("--knob", k)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert "a wide chunk; a narrow chunk and sampled decode steps" in first, first
    launches = int(first.split()[0])
    assert launches > 0


@pytest.mark.parametrize(("shape", "mix", "cuts"), REAL, ids=[f"{s}-{m}" for s, m, _ in REAL])
def test_every_launch_compiles_at_the_real_widths(shape, mix, cuts):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-m", "fuselane.lanes.cuda.compile_check", shape, "--mix", mix]
    argv += [*cuts, "--vocab", SMALL_VOCAB]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a narrow chunk and sampled decode steps" in done.stdout.splitlines()[0]


# Widths no published shape has (`fuzz/lane_shapes.py` draws such): heads of 80 values, padded to a power of two
# in the prefill attention's tile; rows of 1,472 and 704 values, which the in-kernel and grouped GEMMs step two
# blocks at a time (the Q3_K_M recipe's experts fall back to IQ4_NL there).
ODD = {
    "heads-of-80": (Shape("qwen2", 1472, 1, 8, 2, 80, 4160, 512), "q8_0", ["prefill=in-place"]),
    # heads of 48 in groups of three: the decode attention's seam counters (atomics) in the int8 store
    "heads-of-48-in-threes": (Shape("qwen3", 512, 1, 6, 2, 48, 1536, 512), "q8_0", []),
    "experts-of-704": (replace(SHAPES["qwen1.5-moe-a2.7b"], n_embd=704, n_layers=1, n_heads=8, n_kv_heads=1,
                                experts=8, expert_ff=448, shared_ff=1984, vocab=512), "q3_k_m", []),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ODD))
def test_every_launch_compiles_at_widths_no_published_shape_has(case, tmp_path):
    shape, mix, knobs = ODD[case]
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, seed=1)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-m", "fuselane.lanes.cuda.compile_check", str(path)]
    argv += [a for k in knobs for a in ("--knob", k)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a narrow chunk and sampled decode steps" in done.stdout.splitlines()[0]


def test_the_super_block_prefill_compiles_without_spills_at_the_7b_widths():
    # prefill=in-place on a Q4_K_M 7B layer: every product takes the super-block GEMM (Q4_K, Q6_K) after its
    # activation's f16 launch, and neither spills (a spill is a kernel slower than its design)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-m", "fuselane.lanes.cuda.compile_check", "qwen2.5-7b", "--mix", "q4_k_m"]
    argv += ["--layers", "1", "--vocab", SMALL_VOCAB, "--knob", "prefill=in-place", "--usage"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    usage = {line.split()[0]: line for line in done.stdout.splitlines()[1:] if line.startswith("  _")}
    for kernel in ("_gemm_sb_kernel", "_f16_sums_kernel"):
        assert kernel in usage, done.stdout
        assert " 0 stack bytes" in usage[kernel], usage[kernel]


def test_a_kernel_the_compiler_refuses_fails_the_check(tmp_path):
    """Not vacuous: a kernel reading a plain global (which the interpreter takes) fails, named."""
    script = tmp_path / "bad.py"
    script.write_text(
        "import triton, triton.language as tl, torch\n"
        "from fuselane.lanes.cuda.compile_check import Report, compiling\n"
        "LIMIT = 2.0\n"
        "@triton.jit\n"
        "def plain_global(x):\n"
        "    tl.store(x, tl.load(x) * LIMIT)\n"
        "report = Report()\n"
        "try:\n"
        "    with compiling(90, report):\n"
        "        plain_global[(1,)](torch.zeros(4))\n"
        "except Exception:\n"
        "    print(report.failure[0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.stdout.strip() == "plain_global", done.stdout + done.stderr


def test_the_usage_shows_the_range_of_a_kernels_registers():
    # a launch whose specialization takes more registers (Qwen3-Next's gate/up with a folded shared expert in
    # f32 products: 146 against 86) holds fewer blocks a SM, which the most alone does not show
    from fuselane.lanes.cuda.compile_check import Report

    report = Report(kernels={"_gate_up_kernel": 2, "_down_kernel": 1})
    report.note_usage("_gate_up_kernel", 86, 0)
    report.note_usage("_gate_up_kernel", 146, 0)
    report.note_usage("_down_kernel", 60, 16)
    lines = {line.split()[0]: line for line in report.render().splitlines()[1:]}
    assert "86-146 registers" in lines["_gate_up_kernel"] and " 0 stack bytes" in lines["_gate_up_kernel"]
    assert " 60 registers" in lines["_down_kernel"] and " 16 stack bytes" in lines["_down_kernel"]


def test_the_wide_chunk_is_past_the_rows_where_a_launch_changes_form():
    # a chunk's products leave the GEMV past its rows, and a rotation launch takes tiles of rows and heads past
    # its one-head rows: the check's wide chunk must compile both
    from fuselane.lanes.cuda import compile_check
    from fuselane.lanes.cuda.plan import attn_kernels, kernels

    assert compile_check.WIDE_PROMPT > max(kernels.GEMV_ROWS, attn_kernels.ROPE_ONE_HEAD_ROWS)
    assert compile_check.CTX > compile_check.WIDE_PROMPT + compile_check.DECODE_TOKENS
