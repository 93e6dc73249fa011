"""The expanded latent attention's kernels (`triton.mla.expand`, `triton.mla.expanded_attention`) against the cpu
lane's kernels in f64, at tiny shapes, under the interpreter on a CPU.

Bounds: a half's output is a dot of `a` products of f16 operands (the latents given f16, as the `cache` knob
keeps them; the checkpoint's values rounded to f16 once, within U16 relative each), summed in f32: within
(U16 + gamma_(a + 8)) of sum |w x| of the f64 product of the dequantized rows (Higham 3.1), plus the output's own
rounding where it is f16. The attention's operands are given f16 (the query, the expanded keys and values, the
cache's rotated keys), so its scores' products are exact and their f32 sums within gamma_qk of sum |q k|, each
weight rounded to f16 (U16) before the values' product, summed over at most `len` rows in f32: the output within
(2 * score error + 2 U16 + gamma_(len + 8)) of twice the largest value.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, U16, U32, dev, gamma, raw_weights  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.graph.ops import Attention, HeadMatmul  # noqa: E402
from fuselane.lanes.cpu import kernels as cpu  # noqa: E402
from fuselane.lanes.cpu.latent_kernels import head_matmul  # noqa: E402
from fuselane.lanes.cuda.triton.mla import expand, expanded_attention  # noqa: E402

ROUNDINGS = 8
HEADS = 2
ROPE_TAIL = 16  # the cache row's rotated key after the latent: the halves read past it at the row's pitch


def _halves_reference(raw, fmt, x, a, b, rows_out):
    """(the f64 product, sum |w x|) of every cached row through each head's half, by the cpu lane's kernel."""
    if rows_out:
        w = dequantize(raw, fmt, (HEADS, b, a), dtype=np.float64)
    else:  # a head's rows are its inputs: the product's (b, a) matrix is their transpose
        w = dequantize(raw, fmt, (HEADS, a, b), dtype=np.float64).transpose(0, 2, 1)
    spec = HeadMatmul(x.shape[0], HEADS, a, b)
    xs = np.tile(x.astype(np.float64), (1, HEADS))  # every head reads the same cached row
    return head_matmul(spec, [xs, w], 0), head_matmul(spec, [np.abs(xs), np.abs(w)], 0)


@pytest.mark.parametrize(
    ("fmt", "rows_out", "a", "b", "cache", "out_dtype"),
    [(Format.Q8_0, True, 64, 16, np.float16, torch.float32), (Format.Q4_K, True, 256, 16, np.float16, torch.float16),
     (Format.F16, True, 32, 48, np.float32, torch.float32), (Format.Q8_0, False, 32, 64, np.float16, torch.float16),
     (Format.Q5_0, False, 64, 32, np.float16, torch.float32), (Format.F32, False, 32, 48, np.float16, torch.float32),
     (Format.F16, False, 32, 16, np.float16, torch.float16)],
)  # fmt: skip
def test_a_half_expands_every_cached_row_up_to_the_chunks_last(fmt, rows_out, a, b, cache, out_dtype):
    rng = np.random.default_rng(11)
    length, pos, rows = 80, 60, 9  # the rows 0..68 expanded: two tiles of 64, the second ragged
    raw = raw_weights(fmt, HEADS * (b if rows_out else a), a if rows_out else b, rng)
    kc = rng.standard_normal((length, a + ROPE_TAIL)).astype(np.float16).astype(cache)  # f16 values either way
    out = torch.full((length, HEADS * b), float("nan"), dtype=out_dtype, device=DEVICE)
    expand.expand(dev(kc), dev(raw), fmt, dev(np.array([pos], np.int32)), out, heads=HEADS, a=a, b=b,
                  rows_out=rows_out, rows=rows)  # fmt: skip
    got = out.double().cpu().numpy()
    end = pos + rows
    assert np.isnan(got[end:]).all()  # rows past the chunk's last are left alone
    want, size = _halves_reference(raw, fmt, kc[:end, :a], a, b, rows_out)
    bound = (U16 + gamma(a + ROUNDINGS)) * size + (U16 * np.abs(want) if out_dtype == torch.float16 else 0)
    assert np.all(np.abs(got[:end] - want) <= bound + 1e-30)


def test_a_half_declines_what_it_cannot_tile():
    assert not expand.runs_in_tiles(Format.Q4_K, 512, 128, False)  # the key half's rows of 128: no K-quant
    assert not expand.runs_in_tiles(Format.Q8_0, 48, 16, True)  # the latent not whole 32-value blocks
    assert expand.runs_in_tiles(Format.Q5_0, 512, 128, False) and expand.runs_in_tiles(Format.Q4_K, 512, 128, True)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize(
    ("rows", "pos", "nope", "rope", "vd", "f16_ops"),
    [(9, 0, 16, 16, 16, True), (9, 70, 16, 16, 16, True), (70, 5, 48, 16, 32, True), (9, 30, 16, 16, 16, False)],
)
def test_the_expanded_attention_is_each_heads_causal_attention(rows, pos, nope, rope, vd, f16_ops):
    rng = np.random.default_rng(12)
    length, lora = 96, 32
    qk = nope + rope
    qproj = _f16(rng.standard_normal((rows, HEADS * qk)))  # the projection: each head's unrotated part first
    qrot = _f16(rng.standard_normal((rows, HEADS * rope)))  # the rotated parts
    keys = rng.standard_normal((length, HEADS * nope)).astype(np.float16)
    values = rng.standard_normal((length, HEADS * vd)).astype(np.float16)
    kc = rng.standard_normal((length, lora + rope)).astype(np.float16)
    out = torch.zeros((rows, HEADS * vd), device=DEVICE)
    scale = 1 / np.sqrt(qk)
    expanded_attention.expanded_attention(
        dev(qproj), HEADS * qk, qk, dev(qrot), dev(keys), dev(values), dev(kc), dev(np.array([pos], np.int32)), out,
        rows=rows, heads=HEADS, nope=nope, rope=rope, vd=vd, lora=lora, scale=float(scale), f16_ops=f16_ops,
    )  # fmt: skip
    q = np.concatenate([qproj.reshape(rows, HEADS, qk)[..., :nope], qrot.reshape(rows, HEADS, rope)], -1)
    shared = np.repeat(kc[:, None, lora:], HEADS, axis=1).astype(np.float64)
    k = np.concatenate([keys.reshape(length, HEADS, nope).astype(np.float64), shared], -1).reshape(length, -1)
    spec = Attention(rows, HEADS, HEADS, qk, length, float(scale), vd=vd)
    want = cpu.attention(spec, [q.reshape(rows, -1).astype(np.float64), k, values.astype(np.float64)], pos)
    score_err = (gamma(qk + 2) + 4 * U32) * scale * np.abs(q).sum(-1).max() * np.abs(k).max() * np.log2(np.e)
    span = pos + rows
    bound = (2 * score_err + 2 * U16 + gamma(span + ROUNDINGS)) * np.abs(values[:span]).max() * 2
    assert np.max(np.abs(out.double().cpu().numpy() - want)) <= bound
