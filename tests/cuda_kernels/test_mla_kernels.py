"""The absorbed latent attention's kernels (`triton.mla`) against the cpu lane's kernels in f64, at tiny
shapes, under the interpreter on a CPU.

Bounds: a per-head product's dot of `a` exact products is within gamma_(a + 8) of sum |w x| (Higham 3.1, as
test_moe_kernels.py), the weights dequantized by `gguf.dequant`. The rotation's angle (pos * freq, the
frequency rounded to f32 once, the product once) is within 2u of its size, so a turned pair moves by at most
that times the pair's length, plus a few roundings of cos, sin and the two products. The attention sums in
f32 over at most `len` rows (in shares merged by their maxima: a few roundings more): scores within gamma_kw
of sum |q k|, whose error moves each weight by at most that relative, and the sum of weighted values within
gamma_len of the largest value; the query and the cache are given exactly representable (the cache in f16),
so the reference sees the kernel's operands.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, U32, dev, gamma, raw_weights  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.graph.ops import (  # noqa: E402
    Attention,
    ExpertChoice,
    Gating,
    HeadMatmul,
    Join,
    Rope,
    RouteWeights,
    TopK,
    Yarn,
)
from fuselane.lanes.cpu import kernels as cpu  # noqa: E402
from fuselane.lanes.cpu.latent_kernels import expert_choice, head_matmul, inv_freq  # noqa: E402
from fuselane.lanes.cpu.moe_kernels import route_weights  # noqa: E402
from fuselane.lanes.cuda.triton.mla import attention, heads, parts, whole  # noqa: E402
from fuselane.lanes.cuda.triton.moe import route  # noqa: E402

ROUNDINGS = 8
TRIG = 4  # roundings of cos, sin, the two products and their sum, in units of u, per turned value


@pytest.mark.parametrize(
    ("fmt", "m", "a", "b", "strided"),
    [(Format.Q8_0, 1, 32, 16, True), (Format.Q4_K, 1, 256, 8, False), (Format.Q5_0, 2, 64, 16, True),
     (Format.F16, 3, 16, 32, True),
     (Format.F32, 2, 24, 8, False), (Format.Q8_0, 10, 32, 16, True),
     (Format.BF16, 2, 16, 32, True), (Format.BF16, 1, 64, 16, False)],
)  # fmt: skip
def test_head_matmul_is_each_heads_product(fmt, m, a, b, strided):
    # V2-Lite's Q4_K_M: the key half Q5_0 rows of 128 read at the query's pitch, the value half Q4_K of 512;
    # BF16 rows of 16 values (a tiny model's key half: the float kernel) and of 64 (the block formats' GEMV)
    rng = np.random.default_rng(5)
    h = 3
    raw = raw_weights(fmt, h * b, a, rng)
    w = dequantize(raw, fmt, (h, b, a), dtype=np.float64)
    pitch = a + 16 if strided else a  # the query's unrotated slice: a head's values `pitch` apart
    whole = rng.standard_normal((m * h, pitch)).astype(np.float32)
    x = whole[:, :a]
    out = torch.zeros((m, h * b))
    heads.head_matmul(dev(whole), h * pitch, pitch, m, dev(raw), fmt, h, a, b, out)
    want = head_matmul(HeadMatmul(m, h, a, b), [x.astype(np.float64).reshape(m, -1), w], 0)
    bound = gamma(a + ROUNDINGS) * head_matmul(HeadMatmul(m, h, a, b), [np.abs(x).reshape(m, -1), np.abs(w)], 0)
    assert np.all(np.abs(out.double().numpy() - want) <= bound + 1e-30)


@pytest.mark.parametrize(
    ("fmt", "m", "a"),
    [(Format.Q4_K, 1, 256), (Format.Q8_0, 3, 32), (Format.F16, 2, 16), (Format.Q5_0, 10, 64)],
)  # fmt: skip
def test_head_matmul_writes_the_int8_form_the_quantize_launch_would(fmt, m, a):
    # the value half's product under GemvQuant: heads of 64 outputs (two blocks: a program a block), the codes,
    # scales and sums of what the same launch wrote in f32, bit for bit (the product still within its bound)
    from fuselane.lanes.cuda.triton import quant

    rng = np.random.default_rng(8)
    h, b = 3, 64
    raw = raw_weights(fmt, h * b, a, rng)
    w = dequantize(raw, fmt, (h, b, a), dtype=np.float64)
    x = rng.standard_normal((m * h, a)).astype(np.float32)
    out, q8 = torch.zeros((m, h * b)), quant.empty_q8(m, h * b, DEVICE)
    heads.head_matmul(dev(x), h * a, a, m, dev(raw), fmt, h, a, b, out, out_q8=q8)
    want = head_matmul(HeadMatmul(m, h, a, b), [x.astype(np.float64).reshape(m, -1), w], 0)
    bound = gamma(a + ROUNDINGS) * head_matmul(HeadMatmul(m, h, a, b), [np.abs(x).reshape(m, -1), np.abs(w)], 0)
    assert np.all(np.abs(out.double().numpy() - want) <= bound + 1e-30)
    again = quant.quantize(out.to(DEVICE), quant.empty_q8(m, h * b, DEVICE))
    for got, expected in zip(q8, again, strict=True):
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        heads.head_matmul(dev(x), h * a, a, m, dev(raw), fmt, h, a, 16, torch.zeros((m, h * 16)), out_q8=q8)


def test_join_places_each_heads_parts():
    rng = np.random.default_rng(6)
    rows, h, wa, wb = 3, 4, 8, 6
    a = rng.standard_normal((rows, h * wa)).astype(np.float32)
    b = rng.standard_normal((rows, h * wb)).astype(np.float32)
    out = torch.zeros((rows, h * (wa + wb)))
    parts.join(dev(a), dev(b), out, rows, h, wa, wb)
    want = cpu.join(Join(rows, h, h * wa, h * wb), [a, b], 0)
    assert np.array_equal(out.numpy(), want)


YARN = Yarn(factor=4.0, original=256, beta_fast=32.0, beta_slow=1.0)


@pytest.mark.parametrize(("half", "yarn", "pos"), [(False, None, 0), (False, YARN, 37), (True, YARN, 5)])
def test_rope_turns_deepseeks_pairs_by_the_table(half, yarn, pos):
    rng = np.random.default_rng(7)
    rows, h, hd, pitch, base = 3, 2, 16, 40, 10_000.0
    whole = rng.standard_normal((rows * h, pitch)).astype(np.float32)
    x = whole[:, 24 : 24 + hd]  # the rotated slice of a query's projection, read in place
    table = dev(inv_freq(hd, base, yarn).astype(np.float32))
    out = torch.zeros((rows, h * hd))
    src = dev(whole)
    parts.rope(src[:, 24:], h * pitch, pitch, out, dev(np.array([pos], np.int32)), table, rows=rows, heads=h,
               hd=hd, half=half)  # fmt: skip
    spec = Rope(rows, h, hd, base, half=half, yarn=yarn)
    want = cpu.rope(spec, [x.astype(np.float64).reshape(rows, -1)], pos)
    angle = (pos + rows) * inv_freq(hd, base, yarn).max()
    length = np.abs(x).reshape(rows, h, hd)
    pair = np.sqrt(length[..., 0::2] ** 2 + length[..., 1::2] ** 2).max()
    assert np.max(np.abs(out.double().numpy() - want)) <= (2 * angle + TRIG) * U32 * pair * 4


NEVER_SHORT = whole.NEVER
SLICED_SHORT = whole.Short(rows=64, values=16, tile_rows=16, chunk=16)  # two slices of the width, three chunks
SHARED_SHORT = whole.Short(rows=64, values=16, tile_rows=8, chunk=16, shares=4, share_rows=8)  # merged in one read


@pytest.mark.parametrize(("rows", "pos", "splits", "short"), [
    (1, 0, 1, NEVER_SHORT), (1, 20, 3, NEVER_SHORT), (5, 3, 1, NEVER_SHORT), (2, 25, 4, NEVER_SHORT),
    (1, 0, 2, NEVER_SHORT), (1, 20, 3, whole.Short()), (1, 25, 4, SLICED_SHORT), (1, 0, 2, SLICED_SHORT),
    (5, 3, 2, whole.Short(rows=5, values=16, tile_rows=16, chunk=32)), (1, 25, 1, SHARED_SHORT),
    (1, 12, 2, SHARED_SHORT), (1, 5, 1, SHARED_SHORT), (2, 20, 2, SHARED_SHORT),
])  # fmt: skip
def test_latent_attention_attends_the_latents(rows, pos, splits, short):
    """Split and merged (`NEVER_SHORT`), whole (`whole.Short`: the plan's, whose one slice is wider than the
    latent, and two slices of it), a chunk whose first rows run whole and the rest split, and whole in shares
    merged in one read (`SHARED_SHORT`: 26 rows in four shares, 13 in two, 6 in one)."""
    rng = np.random.default_rng(8)
    h, lora, rope_w, ctx = 4, 32, 16, 32
    kw = lora + rope_w
    cache = rng.standard_normal((ctx, kw)).astype(np.float16)  # the cache in f16, as the `cache` knob keeps it
    q = rng.standard_normal((rows, h * kw)).astype(np.float32)
    out = torch.zeros((rows, h * lora))
    kc = dev(cache)
    scale = 1 / np.sqrt(24.0)
    work = attention.scratch(rows, h, lora, splits, DEVICE, short=short)
    for _ in range(2):  # the counters re-arm: a second launch runs the same
        attention.latent_attention(dev(q), kc, kc[:, :lora], dev(np.array([pos], np.int32)), out, rows=rows,
                                   heads=h, kw=kw, vd=lora, scale=float(scale), splits=splits, work=work,
                                   short=short)  # fmt: skip
    assert not work[1].any()
    c = cache.astype(np.float64)
    spec = Attention(rows, h, 1, kw, ctx, float(scale), vd=lora)
    want = cpu.attention(spec, [q.astype(np.float64), c, c[:, :lora].copy()], pos)
    span = pos + rows
    score_err = gamma(kw + 2) * scale * np.abs(q).reshape(rows, h, kw).sum(-1).max() * np.abs(c).max()
    bound = (2 * score_err + gamma(span + 2)) * np.abs(c[:span, :lora]).max() * 2
    assert np.max(np.abs(out.double().numpy() - want)) <= bound


@pytest.mark.parametrize(("sigmoid", "bias", "renorm", "scale", "rows"), [
    (True, True, True, 2.5, 1), (True, False, False, 1.0, 3), (False, False, False, 16.0, 2),
    (False, True, True, 1.0, 1),
])  # fmt: skip
def test_route_gates_by_sigmoid_with_the_correction_bias(sigmoid, bias, renorm, scale, rows):
    rng = np.random.default_rng(9)
    experts, d, k = 16, 64, 4
    w = rng.standard_normal((experts, d)).astype(np.float32)
    x = (rng.standard_normal((rows, d)) * 0.2).astype(np.float32)
    b = (rng.standard_normal(experts) * 0.3).astype(np.float32)
    ids, weights = torch.zeros((rows, k), dtype=torch.int32), torch.zeros((rows, k))
    scores, counter = torch.zeros((rows, experts)), route.counters(DEVICE, rows)
    route.route(dev(x), dev(w.view(np.uint8)), Format.F32, experts, k, renorm, ids, weights, scores, counter,
                sigmoid=sigmoid, bias=dev(b) if bias else None, scale=scale)  # fmt: skip
    gating = Gating.SIGMOID if sigmoid else Gating.SOFTMAX
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    choice = expert_choice(ExpertChoice(rows, experts, gating, bias), [exact, b.astype(np.float64)], 0)
    ranked = -np.sort(-choice, -1)
    assert np.all(ranked[:, k - 1] - ranked[:, k] > 1e-4), "a near-tie: pick another seed"
    want_ids = cpu.KERNELS[TopK](TopK(rows, experts, k), [choice], 0)
    assert np.array_equal(ids.numpy(), want_ids)
    want_w = route_weights(RouteWeights(rows, experts, k, renorm, gating, scale), [exact, want_ids], 0)
    np.testing.assert_allclose(weights.numpy(), want_w, rtol=1e-5, atol=1e-7)
    assert not counter.any()


@pytest.mark.parametrize("short", [whole.Short(), whole.Short(rows=6, values=16, tile_rows=16, chunk=16)])
def test_a_batch_attends_and_turns_each_sequence_at_its_own_position(short):
    """Every sequence whole (the plan's short path), and the last past a short span of 6 rows, split."""
    rng = np.random.default_rng(10)
    seqs, h, lora, rope_w, block = 3, 2, 32, 16, 8
    kw = lora + rope_w
    cache = rng.standard_normal((seqs * block, kw)).astype(np.float16)
    q = rng.standard_normal((seqs, h * kw)).astype(np.float32)
    pos = np.array([0, 5, 7], np.int32)
    out = torch.zeros((seqs, h * lora))
    kc = dev(cache)
    attention.latent_attention(dev(q), kc, kc[:, :lora], dev(pos), out, rows=seqs, heads=h, kw=kw, vd=lora,
                               scale=0.2, seq_rows=block, splits=2, short=short,
                               work=attention.scratch(seqs, h, lora, 2, DEVICE))  # fmt: skip
    c = cache.astype(np.float64)
    spec = Attention(seqs, h, 1, kw, block, 0.2, vd=lora, batched=True)
    want = cpu.attention(spec, [q.astype(np.float64), c, c[:, :lora].copy()], pos)
    np.testing.assert_allclose(out.double().numpy(), want, rtol=0, atol=1e-5 * np.abs(c).max())
    x = rng.standard_normal((seqs, h * rope_w)).astype(np.float32)
    turned = torch.zeros((seqs, h * rope_w))
    table = dev(inv_freq(rope_w, 10_000.0, None).astype(np.float32))
    parts.rope(dev(x), h * rope_w, rope_w, turned, dev(pos), table, rows=seqs, heads=h, hd=rope_w, half=False,
               batched=True)  # fmt: skip
    want = cpu.rope(Rope(seqs, h, rope_w, 10_000.0, half=False, batched=True), [x.astype(np.float64)], pos)
    np.testing.assert_allclose(turned.double().numpy(), want, rtol=0, atol=1e-5 * np.abs(x).max())
