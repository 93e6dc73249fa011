"""The cuda lane's norm, rotation, SwiGLU and arg-max kernels against the cpu lane's NumPy kernels in f64 (its
attention kernels': test_attention_kernels.py, on these shapes, helpers and bounds).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (small, Qwen-like shapes: 4 query heads
over 2 key/value heads, heads of 16-64 values, a 40-row cache); the `cuda` tests run the real shapes (heads of
128 values, 32 query heads over 8, a 4096-row cache) only where a GPU is.

Every tolerance is a bound derived from the arithmetic, written beside it: the kernels compute in f32 (unit
roundoff u = 2^-24) with a GPU's approximate rsqrt/exp2/sin/cos (each within a few u; the bounds allow 4u), and
an f16 cache or f16 operands round each stored value by at most 2^-11 relative. The reference gets exactly the
values the kernel reads (f32 inputs widened to f64), so only the kernel's own rounding is measured, except
where a test compares a rounded cache against unrounded values and says so.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fuselane.gguf.dequant import dequantize_rows  # noqa: E402
from fuselane.gguf.formats import GRID_FORMATS, LAYOUTS, Format  # noqa: E402
from fuselane.gguf.quantize import random_blocks  # noqa: E402
from fuselane.graph.ops import ArgMax, RmsNorm, Rope, Unary, UnaryOp, Yarn  # noqa: E402
from fuselane.lanes.cpu import kernels as ref  # noqa: E402
from fuselane.lanes.cuda.plan import attn_kernels  # noqa: E402
from fuselane.lanes.cuda.run.stored import stored_bytes  # noqa: E402
from fuselane.lanes.cuda.triton import misc, norm, quant, rope  # noqa: E402
from fuselane.numerics.contract import Keep  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
U = Keep.F32.unit_roundoff  # 2^-24
U16 = Keep.F16.unit_roundoff  # 2^-11: an f16 cache's or operand's rounding, relative, per stored value
APPROX = 4  # a GPU approximate rsqrt / exp2 / sin / cos: within 4u (PTX: 2^-22 relative or 2^-21 absolute)
TINY = float(np.finfo(np.float32).tiny)
# f32 prefill operands multiply as 3xTF32 on the GPU: a product within 3 * 2^-20 relative (the interpreter
# multiplies in f32, well inside it)
TF32X3 = 3 * 2.0**-20  # results below f32's normals may flush to zero on the GPU
HEADS, KV, CACHE = 4, 2, 40
QWEN_BASE = 1_000_000.0
EPS = 1e-6


def dev(a: np.ndarray, dtype=torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE, dtype)


def host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).numpy() if t.is_floating_point() else t.cpu().numpy()


def pos_of(p: int) -> torch.Tensor:
    return torch.tensor([p], dtype=torch.int32, device=DEVICE)


def f32(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """Random values exactly representable in f32, as f64 (the reference sees what the kernel reads)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np.float64)


def within(got: np.ndarray, want: np.ndarray, bound: np.ndarray | float, what: str) -> None:
    err = np.abs(got - want)
    excess = err - bound
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.ndim else ()
    assert np.all(excess <= 0), f"{what}: error {err[worst]:.3e} > bound {np.broadcast_to(bound, err.shape)[worst]:.3e}"


# --- norms -----------------------------------------------------------------------------------------------


def norm_rel(cols: int) -> float:
    """Relative error of one output of a weighted RMS norm in f32.

    s = x + r rounds once (u); the sum of squares is a tree of depth log2(cols) over squares that round once
    each, (log2(cols) + 2) u relative; the mean and the eps add round twice more (2u); rsqrt's own error
    (APPROX u) adds to half the mean's (the square root halves a relative error); the two products s*r*w 2u.
    """
    return U * (1 + (math.log2(cols) + 4) / 2 + APPROX + 2)


def weighted_norm(s: np.ndarray, w: np.ndarray, cols: int) -> np.ndarray:
    rows = s.size // cols
    return ref.rms_norm(RmsNorm(rows, cols, EPS), [s.reshape(rows, cols)], 0).reshape(s.shape) * np.resize(w, s.shape)


@pytest.mark.parametrize("cols", [96, 9000])  # one tile held in registers; a row wider than a block's tile
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_cpu(cols, with_residual):
    rng = np.random.default_rng(cols)
    x, r, w = f32(rng, 3, cols), f32(rng, 3, cols), f32(rng, cols)
    out = torch.empty(3, cols, device=DEVICE)
    if with_residual:
        sums = torch.empty(3, cols, device=DEVICE)
        norm.rms_norm(dev(x), dev(w), out, EPS, residual=dev(r), sum_out=sums)
        within(host(sums), x + r, U * np.abs(x + r), "sum")  # one f32 add
        s = x + r
    else:
        norm.rms_norm(dev(x), dev(w), out, EPS)
        s = x
    want = weighted_norm(s, w, cols)
    within(host(out), want, norm_rel(cols) * np.abs(want), "norm")


@pytest.mark.parametrize("cols", [96, 9000])
def test_add_norm_updates_the_residual_in_place(cols):
    """sum_out may be the residual's own buffer: the residual stream updated in place."""
    rng = np.random.default_rng(cols + 1)
    x, r, w = f32(rng, 2, cols), f32(rng, 2, cols), f32(rng, cols)
    stream = dev(r)
    out = torch.empty(2, cols, device=DEVICE)
    norm.rms_norm(dev(x), dev(w), out, EPS, residual=stream, sum_out=stream)
    within(host(stream), x + r, U * np.abs(x + r), "sum")
    want = weighted_norm(x + r, w, cols)
    within(host(out), want, norm_rel(cols) * np.abs(want), "norm")


@pytest.mark.parametrize("cols", [96, 8224])  # one tile; two tiles of 8192 (the second part-filled)
def test_add_norm_writes_its_int8_form_as_quantize_would(cols):
    """AddNormQuant's launch: the quantized norm is `quant.quantize` of the f32 norm it writes, bit for bit."""
    rng = np.random.default_rng(cols + 2)
    x, r, w = f32(rng, 2, cols), f32(rng, 2, cols), f32(rng, cols)
    out, sums = torch.empty(2, cols, device=DEVICE), torch.empty(2, cols, device=DEVICE)
    got, want = quant.empty_q8(2, cols, DEVICE), quant.empty_q8(2, cols, DEVICE)
    norm.rms_norm(dev(x), dev(w), out, EPS, residual=dev(r), sum_out=sums, out_q8=got)
    quant.quantize(out, want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    within(host(out), weighted_norm(x + r, w, cols), norm_rel(cols) * np.abs(weighted_norm(x + r, w, cols)), "norm")


def test_rms_norm_int8_form_takes_whole_rows():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="whole rows"):
        norm.rms_norm(x, torch.ones(32, device=DEVICE), torch.empty_like(x), EPS, out_q8=quant.empty_q8(2, 64, DEVICE))


def test_rms_norm_per_head_reads_a_part_in_place():
    """q's heads normed one by one, read from the q part of a merged q|k|v row (pitch wider than q)."""
    rng = np.random.default_rng(1)
    hd = 32
    merged = f32(rng, 3, (HEADS + 2 * KV) * hd)
    w = f32(rng, hd)
    q = dev(merged)[:, : HEADS * hd]
    out = torch.empty(3, HEADS * hd, device=DEVICE)
    norm.rms_norm(q, dev(w), out, EPS)
    want = weighted_norm(merged[:, : HEADS * hd], w, hd)
    within(host(out), want, norm_rel(hd) * np.abs(want), "per-head norm")
    plain = torch.empty_like(out)
    norm.rms_norm_plain(q, plain, EPS, cols=hd)
    want = ref.rms_norm(RmsNorm(3 * HEADS, hd, EPS), [merged[:, : HEADS * hd]], 0)
    within(host(plain), want, norm_rel(hd) * np.abs(want), "plain per-head norm")


GATHERED = [Format.Q8_0, Format.Q4_K, Format.Q5_0, Format.Q6_K, Format.F16, Format.F32, Format.BF16, Format.Q5_K]
GATHERED += [Format.Q4_0, Format.Q4_1, Format.Q5_1, Format.IQ4_NL, Format.IQ4_XS, Format.Q3_K, Format.Q2_K]
GATHERED += sorted(GRID_FORMATS)  # from their tables (llama.cpp's IQ2_S, IQ2_M and IQ3_XXS mixes' IQ3_S table)


@pytest.mark.parametrize("fmt", GATHERED, ids=lambda f: f.name)
def test_embed_norm_gathers_dequantized_rows(fmt):
    rng = np.random.default_rng(int(fmt))
    vocab, cols = 7, 512
    raw = random_blocks(fmt, vocab * cols // LAYOUTS[fmt].values, rng, scale=0.5).reshape(-1)
    ids = np.array([3, 0, 6, 3], dtype=np.int32)
    w = f32(rng, cols)
    rows_out = torch.empty(len(ids), cols, device=DEVICE)
    out = torch.empty(len(ids), cols, device=DEVICE)
    row_bytes = cols // LAYOUTS[fmt].values * LAYOUTS[fmt].nbytes
    table = torch.from_numpy(stored_bytes(fmt, raw, row_bytes)).to(DEVICE)  # as the lane keeps it (`run/stored.py`)
    norm.embed_norm(table, fmt, dev(ids, torch.int32), dev(w), rows_out, out, EPS)
    gathered = dequantize_rows(raw, fmt, (vocab, cols), ids, dtype=np.float64)
    # the decode is exact: every scale-times-code product is exact in f32, and the one rounding (a K format's
    # minimum) happens on the same two f32 operands as dequant's
    np.testing.assert_array_equal(host(rows_out), gathered)
    want = weighted_norm(gathered, w, cols)
    within(host(out), want, norm_rel(cols) * np.abs(want), "embed norm")


@pytest.mark.parametrize("fmt", [Format.Q4_K, Format.IQ2_XS], ids=lambda f: f.name)
def test_embed_norm_wide_row_decodes_twice(fmt):
    rng = np.random.default_rng(5)
    vocab, cols = 3, 9216  # wider than a norm block's tile: the two-pass path
    raw = random_blocks(fmt, vocab * cols // LAYOUTS[fmt].values, rng, scale=0.5).reshape(-1)
    ids = np.array([2, 1], dtype=np.int32)
    w = f32(rng, cols)
    rows_out, out = torch.empty(2, cols, device=DEVICE), torch.empty(2, cols, device=DEVICE)
    norm.embed_norm(torch.from_numpy(raw).to(DEVICE), fmt, dev(ids, torch.int32), dev(w), rows_out, out, EPS)
    gathered = dequantize_rows(raw, fmt, (vocab, cols), ids, dtype=np.float64)
    np.testing.assert_array_equal(host(rows_out), gathered)
    want = weighted_norm(gathered, w, cols)
    within(host(out), want, norm_rel(cols) * np.abs(want), "embed norm")


# --- rotations -------------------------------------------------------------------------------------------


def rope_ref(x: np.ndarray, heads: int, hd: int, p: int, w: np.ndarray | None, yarn: Yarn | None = None) -> np.ndarray:
    rows = x.shape[0]
    if w is not None:
        x = weighted_norm(x, w, hd)
    return ref.rope(Rope(rows, heads, hd, QWEN_BASE, yarn=yarn), [x], p)


# YaRN's stretch of inv_j in f32: its three constants rounded, then (j - low) * 1/width, ramp * cut, 1 - that,
# and inv_j times it, each one rounding: at most seven u more of inv_j, relative (inv_j <= 1).
YARN_ROUNDINGS = 7


def rope_bound(want: np.ndarray, hd: int, last_pos: int, normed: bool, yarn: bool = False) -> np.ndarray:
    """Error bound of a rotated pair (a, b) -> (a cos - b sin, b cos + a sin), per value.

    The angle p * inv_j: inv_j = 2^(j * e), e = -2 log2(base) / hd rounded to f32 and multiplied by j (two
    roundings, each moving the exponent by j|e| u <= log2(base) u, i.e. inv_j by ln2 log2(base) u relative),
    exp2 itself APPROX u, the product by p one more u: |d angle| <= p (2 ln2 log2(base) + APPROX + 1) u. The
    reduction to [-pi, pi] is exact to u * pi; cos and sin within APPROX u absolute. Each output moves by at
    most (|a| + |b|) (|d angle| + pi u + APPROX u) plus its two products and a sum (3u), plus the norm's
    relative error where normed. |a| + |b| <= sqrt(2) * |rotated pair|, which rotation preserves.
    """
    d_angle = last_pos * (2 * math.log(2) * math.log2(QWEN_BASE) + APPROX + 1 + (YARN_ROUNDINGS if yarn else 0)) * U
    per = d_angle + (math.pi + APPROX + 3) * U + (norm_rel(hd) if normed else 0.0)
    heads = want.reshape(want.shape[0], -1, 2, hd // 2)
    pair = np.sqrt(2 * (heads[:, :, 0] ** 2 + heads[:, :, 1] ** 2))
    return np.broadcast_to((pair * per)[:, :, None, :], heads.shape).reshape(want.shape)


@pytest.mark.parametrize("hd", [16, 32, 64])
@pytest.mark.parametrize("p", [0, 17])
@pytest.mark.parametrize("normed", [False, True])
def test_qk_norm_rope_matches_cpu(hd, p, normed):
    rng = np.random.default_rng(hd + p)
    rows = 3
    merged = f32(rng, rows, 2 * HEADS * hd)  # q is the first half of a wider row: read at its pitch
    w = f32(rng, hd) if normed else None
    out = torch.empty(rows, HEADS * hd, device=DEVICE)
    x = dev(merged)[:, : HEADS * hd]
    kw = dict(norm_w=dev(w), eps=EPS) if normed else {}
    rope.qk_norm_rope(x, out, pos_of(p), heads=HEADS, hd=hd, base=QWEN_BASE, **kw)
    want = rope_ref(merged[:, : HEADS * hd], HEADS, hd, p, w)
    within(host(out), want, rope_bound(want, hd, p + rows, normed), "rope")


@pytest.mark.parametrize("normed", [False, True])
def test_yarn_stretches_the_frequencies_as_the_cpu_lane(normed):
    # a head of 64 values whose 32 frequencies fall on both sides of the ramp (original context 4,096: pairs 0-6
    # keep theirs, 7-15 mix, the rest are divided by the factor), at a position where the stretch shows
    yarn = Yarn(factor=4.0, original=4096, beta_fast=32.0, beta_slow=1.0)
    low, width = yarn.ramp(64, QWEN_BASE)
    assert 0 < low < low + width < 31
    rng = np.random.default_rng(23)
    rows, hd, p = 3, 64, 200
    x, w = f32(rng, rows, HEADS * hd), (f32(rng, hd) if normed else None)
    out = torch.empty(rows, HEADS * hd, device=DEVICE)
    kw = dict(norm_w=dev(w), eps=EPS) if normed else {}
    rope.qk_norm_rope(dev(x), out, pos_of(p), heads=HEADS, hd=hd, base=QWEN_BASE, yarn=yarn, **kw)
    want = rope_ref(x, HEADS, hd, p, w, yarn)
    within(host(out), want, rope_bound(want, hd, p + rows, normed, yarn=True), "yarn")
    plain = rope_ref(x, HEADS, hd, p, w)
    assert np.max(np.abs(plain - want)) > 100 * np.max(rope_bound(want, hd, p + rows, normed, yarn=True))
    # one launch of a query and a key turns them alike
    q_out, k_out = torch.empty(rows, HEADS * hd, device=DEVICE), torch.empty(rows, KV * hd, device=DEVICE)
    k = f32(rng, rows, KV * hd)
    rope.rope_q_k(dev(x), dev(k), q_out, k_out, pos_of(p), heads=HEADS, kv_heads=KV, hd=hd, base=QWEN_BASE,
                  yarn=yarn)  # fmt: skip
    want_k = rope_ref(k, KV, hd, p, None, yarn)
    within(host(k_out), want_k, rope_bound(want_k, hd, p + rows, False, yarn=True), "yarn k")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("p", [0, 29])
def test_rope_kv_append_lands_at_pos(cache_dtype, p):
    rng = np.random.default_rng(p)
    rows, hd, sentinel = 3, 32, 7.0
    x, w = f32(rng, rows, KV * hd), f32(rng, hd)
    cache = torch.full((CACHE, KV * hd), sentinel, dtype=cache_dtype, device=DEVICE)
    rope.qk_norm_rope(
        dev(x), cache, pos_of(p), heads=KV, hd=hd, base=QWEN_BASE, norm_w=dev(w), eps=EPS, cache_row_pitch=KV * hd
    )
    want = rope_ref(x, KV, hd, p, w)
    got = host(cache)
    # an f16 cache rounds each stored value once more: 2^-11 of it, on top of the f32 result's own error
    stored = U16 if cache_dtype == torch.float16 else 0.0
    within(got[p : p + rows], want, rope_bound(want, hd, p + rows, True) * (1 + stored) + stored * np.abs(want), "kv")
    untouched = np.delete(got, np.arange(p, p + rows), axis=0)
    assert np.all(untouched == sentinel), "a row other than pos..pos+rows-1 was written"


@pytest.mark.parametrize("normed", [False, True])
def test_rope_q_k_one_launch(normed):
    rng = np.random.default_rng(11)
    rows, hd, p = 2, 64, 13
    q, k = f32(rng, rows, HEADS * hd), f32(rng, rows, KV * hd)
    qw, kw = (f32(rng, hd), f32(rng, hd)) if normed else (None, None)
    q_out = torch.empty(rows, HEADS * hd, device=DEVICE)
    k_cache = torch.zeros(CACHE, KV * hd, dtype=torch.float16, device=DEVICE)
    weights = dict(q_norm_w=dev(qw), k_norm_w=dev(kw), eps=EPS) if normed else {}
    rope.rope_q_k(
        dev(q), dev(k), q_out, k_cache, pos_of(p), heads=HEADS, kv_heads=KV, hd=hd, base=QWEN_BASE,
        k_cache_row_pitch=KV * hd, **weights,
    )  # fmt: skip
    want_q, want_k = rope_ref(q, HEADS, hd, p, qw), rope_ref(k, KV, hd, p, kw)
    within(host(q_out), want_q, rope_bound(want_q, hd, p + rows, normed), "q")
    bound_k = rope_bound(want_k, hd, p + rows, normed) * (1 + U16) + U16 * np.abs(want_k)
    within(host(k_cache)[p : p + rows], want_k, bound_k, "k in the cache")
    assert not host(k_cache)[:p].any() and not host(k_cache)[p + rows :].any()
    with pytest.raises(ValueError, match="both normed or neither"):
        rope.rope_q_k(dev(q), dev(k), q_out, k_cache, pos_of(p), heads=HEADS, kv_heads=KV, hd=hd, base=1e4,
                      q_norm_w=dev(f32(rng, hd)))  # fmt: skip


@given(
    heads=st.integers(1, 128), half=st.integers(1, attn_kernels.ROPE_HEAD // 2), turned_half=st.integers(0, 128),
    rows=st.integers(1, 1 << 14),
)  # fmt: skip
def test_a_rotation_tile_is_whole_powers_of_two(heads, half, turned_half, rows):
    # Triton takes a tile's sides and a launch's warps only as powers of two; a partial rotary's head (turned
    # pairs and the values after them, each side a power-of-two tile) is no power of two wide
    hd, turned = 2 * half, 2 * min(turned_half, half) or 2 * half
    tile_rows, tile_heads, warps = rope.rope_tile(heads, hd, turned, rows)
    assert all(v >= 1 and v & (v - 1) == 0 for v in (tile_rows, tile_heads, warps))
    assert warps <= attn_kernels.ROPE_WARPS and tile_heads < 2 * heads and tile_rows < 2 * rows


@pytest.mark.parametrize("per_row", [False, True])
def test_a_program_turns_several_rows_and_the_last_is_partial(per_row):
    # Qwen2.5-0.5B's heads (14 over 2 of 64 values): past a decode step's rows a program takes a few rows of a
    # few heads, so 65 rows leave the last row tile rows past the launch's and the last head tiles heads past
    # each side's, which must write nothing
    heads, kv, hd, rows, p = 14, 2, 64, 65, 9
    tile_rows, tile_heads, _ = rope.rope_tile(heads, hd, hd, rows)
    assert 1 < tile_rows < rows and rows % tile_rows and heads % tile_heads and kv < tile_heads
    assert rope.rope_tile(heads, hd, hd, 1)[:2] == (1, 1)  # a decode step: a program a head
    rng = np.random.default_rng(31)
    q, k, qw, kw = f32(rng, rows, heads * hd), f32(rng, rows, kv * hd), f32(rng, hd), f32(rng, hd)
    q_out = torch.full((rows + 1, heads * hd), 3.0, device=DEVICE)
    cache = p + rows + 3
    k_out = torch.full((cache, kv * hd), 3.0, device=DEVICE)
    positions = np.arange(p, p + rows, dtype=np.int32)[::-1].copy() if per_row else np.array([p], np.int32)
    rope.rope_q_k(
        dev(q), dev(k), q_out, k_out, dev(positions, torch.int32), heads=heads, kv_heads=kv, hd=hd,
        base=QWEN_BASE, q_norm_w=dev(qw), k_norm_w=dev(kw), eps=EPS, k_cache_row_pitch=kv * hd, per_row=per_row,
    )  # fmt: skip
    got_q, got_k = host(q_out), host(k_out)
    for i in range(rows):
        at = int(positions[i]) if per_row else p + i
        want_q = rope_ref(q[i : i + 1], heads, hd, at, qw)
        want_k = rope_ref(k[i : i + 1], kv, hd, at, kw)
        within(got_q[i : i + 1], want_q, rope_bound(want_q, hd, at + 1, True), f"q row {i}")
        k_row = i if per_row else at  # a batch's rows land at their own row: the paged attention stores them
        within(got_k[k_row : k_row + 1], want_k, rope_bound(want_k, hd, at + 1, True), f"k row {i}")
    assert np.all(got_q[rows:] == 3.0), "a row past the launch's was written"
    written = set(range(rows)) if per_row else set(range(p, p + rows))
    assert all(np.all(got_k[r] == 3.0) for r in range(cache) if r not in written)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_set_rows_writes_at_pos_rounding_to_the_cache(cache_dtype):
    rng = np.random.default_rng(2)
    x = f32(rng, 3, KV * 32)
    cache = torch.full((CACHE, KV * 32), -1.0, dtype=cache_dtype, device=DEVICE)
    rope.set_rows(dev(x), cache, pos_of(21))
    # round to nearest even, as torch's conversion: bit for bit
    np.testing.assert_array_equal(host(cache)[21:24], host(dev(x).to(cache_dtype)))
    assert np.all(np.delete(host(cache), [21, 22, 23], axis=0) == -1.0)


# --- SwiGLU and arg-max ----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's e^100, on purpose
def test_glu_act_mul_matches_cpu():
    rng = np.random.default_rng(4)
    rows, cols = 3, 1500
    merged = f32(rng, rows, 2 * cols, scale=4.0)  # gate | up halves of one product, read in place
    merged[0, :4] = [-100.0, 100.0, -30.0, 0.0]  # e^-g overflows for g = -100: silu is -0, not NaN
    gate, up = merged[:, :cols], merged[:, cols:]
    out = torch.empty(rows, cols, device=DEVICE)
    m = dev(merged)
    misc.glu_act_mul(m[:, :cols], m[:, cols:], out)
    want = ref.unary(Unary(UnaryOp.SILU, rows, cols), [gate], 0) * up
    # e^-g: the exponent's rounding |g| u, exp2's APPROX u; 1 + e, the quotient and the product 3u; the
    # relative error of e^-g carries to silu at most once
    within(host(out), want, (np.abs(gate) + APPROX + 3) * U * np.abs(want) + TINY, "swiglu")


def test_glu_act_mul_writes_its_int8_form():
    # GluActMulQuant: the launch's own f32 output, quantized as `quant.quantize` does, bit for bit; a row of
    # 1504 values ends in a partial program's whole blocks
    rng = np.random.default_rng(5)
    rows, cols = 2, 1504
    gate, up = f32(rng, rows, cols, scale=4.0), f32(rng, rows, cols, scale=1e5)  # past f16's range
    out = torch.empty(rows, cols, device=DEVICE)
    q8 = quant.empty_q8(rows, cols, DEVICE)
    misc.glu_act_mul(dev(gate), dev(up), out, q8)
    codes, d, s = quant.quantize_reference(out.cpu().numpy())
    assert np.array_equal(q8.q.cpu().numpy(), codes) and np.array_equal(q8.d.cpu().numpy(), d)
    assert np.array_equal(q8.s.cpu().numpy(), s)


def test_argmax_ties_take_the_lowest_index():
    rows, cols = 4, 10_000  # three chunks of 4096
    rng = np.random.default_rng(6)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, [7, 4000]] = 9.0  # a tie within the first chunk
    x[1, [4100, 9000]] = 9.0  # a tie across chunks: the earlier chunk's
    x[2, [4095, 4096]] = 9.0  # either side of a chunk boundary
    x[3, :] = -np.inf  # all equal: index 0
    want = ref.argmax(ArgMax(rows, cols), [x], 0)
    assert list(want) == [7, 4100, 4095, 0]
    for scratch in (None, misc.argmax_scratch(rows, cols, DEVICE)):
        out = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
        misc.argmax(dev(x), out, scratch=scratch)
        np.testing.assert_array_equal(host(out), want)
        if scratch is not None:
            assert not host(scratch[-rows:].view(torch.int32)).any(), "the merge left a counter armed"
            x[0, 12] = 10.0  # run again on new logits with the same scratch
            out64 = torch.empty(rows, dtype=torch.int64, device=DEVICE)
            misc.argmax(dev(x), out64, scratch=scratch)
            assert host(out64)[0] == 12


# --- the real shapes, on a GPU ---------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
R_HEADS, R_KV, R_HD, R_CACHE, R_HIDDEN, R_VOCAB = 32, 8, 128, 4096, 4096, 151_936


@pytest.mark.cuda
@needs_gpu
def test_cuda_norms_rope_glu_argmax_real_shapes():
    rng = np.random.default_rng(10)
    x, r, w = f32(rng, 4, R_HIDDEN), f32(rng, 4, R_HIDDEN), f32(rng, R_HIDDEN)
    out, sums = torch.empty(4, R_HIDDEN, device=DEVICE), torch.empty(4, R_HIDDEN, device=DEVICE)
    norm.rms_norm(dev(x), dev(w), out, EPS, residual=dev(r), sum_out=sums)
    want = weighted_norm(x + r, w, R_HIDDEN)
    within(host(out), want, norm_rel(R_HIDDEN) * np.abs(want), "add norm")

    fmt = Format.Q4_K
    raw = random_blocks(fmt, 64 * R_HIDDEN // LAYOUTS[fmt].values, rng, scale=0.5).reshape(-1)
    ids = np.array([63, 5], dtype=np.int32)
    rows_out, out2 = torch.empty(2, R_HIDDEN, device=DEVICE), torch.empty(2, R_HIDDEN, device=DEVICE)
    norm.embed_norm(torch.from_numpy(raw).to(DEVICE), fmt, dev(ids, torch.int32), dev(w), rows_out, out2, EPS)
    np.testing.assert_array_equal(host(rows_out), dequantize_rows(raw, fmt, (64, R_HIDDEN), ids, dtype=np.float64))

    p, rows = R_CACHE - 8, 4
    q, k = f32(rng, rows, R_HEADS * R_HD), f32(rng, rows, R_KV * R_HD)
    qw, kw = f32(rng, R_HD), f32(rng, R_HD)
    q_out = torch.empty(rows, R_HEADS * R_HD, device=DEVICE)
    k_cache = torch.zeros(R_CACHE, R_KV * R_HD, dtype=torch.float16, device=DEVICE)
    rope.rope_q_k(
        dev(q), dev(k), q_out, k_cache, pos_of(p), heads=R_HEADS, kv_heads=R_KV, hd=R_HD, base=QWEN_BASE,
        q_norm_w=dev(qw), k_norm_w=dev(kw), eps=EPS, k_cache_row_pitch=R_KV * R_HD,
    )  # fmt: skip
    want_q = ref.rope(Rope(rows, R_HEADS, R_HD, QWEN_BASE), [weighted_norm(q, qw, R_HD)], p)
    within(host(q_out), want_q, rope_bound(want_q, R_HD, p + rows, True), "q at a long position")

    gate, up = f32(rng, 2, 11008, scale=4.0), f32(rng, 2, 11008)
    glu = torch.empty(2, 11008, device=DEVICE)
    misc.glu_act_mul(dev(gate), dev(up), glu)
    want = ref.unary(Unary(UnaryOp.SILU, 2, 11008), [gate], 0) * up
    within(host(glu), want, (np.abs(gate) + APPROX + 3) * U * np.abs(want) + TINY, "swiglu")

    logits = rng.standard_normal((1, R_VOCAB)).astype(np.float32)
    logits[0, [77_000, 150_000]] = 50.0
    top = torch.empty(1, dtype=torch.int32, device=DEVICE)
    misc.argmax(dev(logits), top, scratch=misc.argmax_scratch(1, R_VOCAB, DEVICE))
    assert int(top.item()) == 77_000
