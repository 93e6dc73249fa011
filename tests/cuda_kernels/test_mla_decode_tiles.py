"""The latent attention's decode kernel (`triton.mla.attention`) with its tiling exercised at a tiny shape,
under the interpreter on a CPU, against softmax attention computed here in f64: several blocks of heads a
row (the last one partly past the heads), several value slices, several shares of the span merged in one level
and in two, shares past the position that must write and be read nowhere (the scratch starts as NaN), a
chunk's rows at their own positions, and a batch of sequences each over its own block of the cache (`seq_rows`).
And at the real widths (DeepSeek-V2-Lite's 16 heads, V3's 128) the kernel compiles for an H200 without spills.

Bound (as test_mla_kernels.py): a score is an f32 sum of `kw` exact products (the query and the f16 cache
exactly representable), scaled once: within gamma_(kw + 2) of sum |q k| * scale, which moves each softmax
weight by at most twice that, relative; the weighted sum of the latents in f32 over at most `span` rows,
merged across shares by their maxima (a few roundings more), is within gamma_(span + 2) of the largest latent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, dev, gamma  # noqa: E402

from fuselane.lanes.cuda.triton.mla import attention  # noqa: E402

LORA, ROPE = 32, 16
KW = LORA + ROPE
REGISTERS = Path(__file__).resolve().parents[2] / "benchmarks" / "mla_registers.py"
TIMEOUT = 300  # seconds: two compiles of one kernel


def attend(q: np.ndarray, cache: np.ndarray, ends: np.ndarray, heads: int, scale: float) -> np.ndarray:
    """[rows, heads * LORA]: row i's heads over cached rows 0..ends[i] - 1 of `cache[i]`, in f64."""
    out = []
    for qi, ci, end in zip(q, cache, ends, strict=True):
        s = qi.reshape(heads, KW) @ ci[:end].T * scale
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out.append((w / w.sum(axis=1, keepdims=True) @ ci[:end, :LORA]).reshape(-1))
    return np.stack(out)


def bound(q: np.ndarray, cache: np.ndarray, heads: int, scale: float, span: int) -> float:
    score = gamma(KW + 2) * scale * np.abs(q).reshape(-1, heads, KW).sum(-1).max() * np.abs(cache).max()
    return (2 * score + gamma(span + 2)) * np.abs(cache[..., :LORA]).max() * 2


def run(q, cache, pos, *, heads, rows, splits, heads_a_program, value_slices, seq_rows=0) -> torch.Tensor:
    out = torch.zeros((rows, heads * LORA))
    kc = dev(cache.reshape(-1, KW))
    tiles = dict(value_slices=value_slices, heads_a_program=heads_a_program)
    work = attention.scratch(rows, heads, LORA, splits, DEVICE, **tiles)
    work[0].fill_(float("nan"))  # a share that holds no rows writes no partial, and none is read
    for _ in range(2):  # the counters re-arm: a second launch runs the same
        attention.latent_attention(dev(q), kc, kc[:, :LORA], dev(pos), out, rows=rows, heads=heads, kw=KW, vd=LORA,
                                   scale=0.2, seq_rows=seq_rows, splits=splits, work=work, **tiles)  # fmt: skip
    assert not work[1].any()
    return out


@pytest.mark.parametrize(
    ("rows", "pos", "splits", "heads_a_program", "value_slices"),
    [(1, 40, 3, 2, 2), (2, 21, 1, 4, 1), (1, 0, 2, 8, 4), (3, 33, 4, 4, 2), (1, 100, 8, 2, 2), (2, 90, 6, 4, 1)],
)  # fmt: skip
def test_blocks_of_heads_and_value_slices_attend_as_one(rows, pos, splits, heads_a_program, value_slices):
    # past `attn_kernels.MLA_MERGE_BATCH` shares that hold rows, the merge takes two levels (`attention.clusters`)
    rng = np.random.default_rng(11)
    heads, ctx = 6, 128  # 6 heads: a row's last block is partly past them
    cache = rng.standard_normal((ctx, KW)).astype(np.float16)
    q = rng.standard_normal((rows, heads * KW)).astype(np.float32)
    out = run(q, cache, np.array([pos], np.int32), heads=heads, rows=rows, splits=splits,
              heads_a_program=heads_a_program, value_slices=value_slices)  # fmt: skip
    c = cache.astype(np.float64)
    ends = pos + 1 + np.arange(rows)
    want = attend(q.astype(np.float64), [c] * rows, ends, heads, 0.2)
    assert np.max(np.abs(out.double().numpy() - want)) <= bound(q, c, heads, 0.2, int(ends.max()))


def test_a_batchs_rows_attend_their_own_blocks_in_blocks_of_heads():
    rng = np.random.default_rng(12)
    seqs, heads, block = 3, 5, 100
    cache = rng.standard_normal((seqs, block, KW)).astype(np.float16)
    q = rng.standard_normal((seqs, heads * KW)).astype(np.float32)
    pos = np.array([0, 17, 99], np.int32)  # one share, two, and seven (a merge in two levels)
    out = run(q, cache, pos, heads=heads, rows=seqs, splits=7, heads_a_program=2, value_slices=2, seq_rows=block)
    c = cache.astype(np.float64)
    want = attend(q.astype(np.float64), list(c), pos + 1, heads, 0.2)
    assert np.max(np.abs(out.double().numpy() - want)) <= bound(q, c, heads, 0.2, block)


MOST_STACK_BYTES = 8  # one 8-byte value


def test_the_kernel_compiles_with_at_most_a_word_spilled_at_deepseeks_widths():
    # a compile for sm_90 in a process whose kernels were never decorated under the interpreter. With the short
    # span's path in the same kernel (168 registers), ptxas keeps one 8-byte value on the stack at 16 heads (one
    # store, two loads a program); the kernel before the short span spilled none, the one before that 1,856 bytes
    # a thread: the bound catches a real spill again
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, str(REGISTERS), "--heads", "16,128", "--splits", "4"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("new")]
    assert len(lines) == 2, done.stdout
    stack = [int(line.split(" stack bytes")[0].split()[-1]) for line in lines]
    assert max(stack) <= MOST_STACK_BYTES, done.stdout
