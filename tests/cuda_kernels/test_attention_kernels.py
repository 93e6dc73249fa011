"""The cuda lane's decode and prefill attention kernels against the cpu lane's NumPy attention in f64: the split
decode with its merge (plain and as a dependent launch), each group's key/value head, its int8 output form; the
prefill's tiles, its f16 operands and its int8 form; and the real shapes on a GPU. Shapes, helpers and the bounds'
reasoning are `test_norm_rope_attention`'s (its docstring says how each tolerance is derived).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fuselane.graph.ops import Attention  # noqa: E402
from fuselane.lanes.cpu import kernels as ref  # noqa: E402
from fuselane.lanes.cuda.triton import pdl, quant  # noqa: E402
from fuselane.lanes.cuda.triton.attention import decode as attention  # noqa: E402
from fuselane.lanes.cuda.triton.attention import prefill as attention_prefill  # noqa: E402
from tests.cuda_kernels.test_norm_rope_attention import (  # noqa: E402
    APPROX,
    CACHE,
    DEVICE,
    HEADS,
    KV,
    R_CACHE,
    R_HD,
    R_HEADS,
    R_KV,
    TF32X3,
    U16,
    U,
    dev,
    f32,
    host,
    needs_gpu,
    pos_of,
    within,
)

# --- attention -------------------------------------------------------------------------------------------


def attention_bound(q, k, v, rows: int, span: int, hd: int, scale: float, stored: float, operand: float = 0.0):
    """Error bound of causal attention's outputs, one value a query row (the worst head).

    A score s = scale * q.k sums hd products in f32: |ds| <= (hd + 2) u S, S = scale * sum |q_d k_d| (the
    largest over the row's heads and keys), plus `stored` S where the keys the reference reads were rounded
    (2^-11 for an f16 cache against unrounded keys) and 2 `operand` S where the kernel's products round their
    operands (f16 operands: the weights to 2^-11; 3xTF32: each product to 3 * 2^-20). A weight
    2^(s log2e - max) then moves by eps_p <= 2 |ds| + (2 S log2e + APPROX) u relative (both s and the max, the
    exponent's rounding, exp2). Relative weight errors eps_p move a weighted mean of values by at most
    2 eps_p max|v|; the sums over span values (and the splits' merge) add (span + 4) u max|v|; f16 values add
    `stored` max|v|, the second product's operands `operand` max|v|.
    """
    group = q.shape[1] // hd // (k.shape[1] // hd)
    qh = np.abs(q.reshape(rows, -1, hd))
    kh = np.abs(k[:span].reshape(span, -1, hd))
    s = scale * np.einsum("rhd,nhd->rhn", qh, np.repeat(kh, group, axis=1))
    big_s = s.max(axis=(1, 2))
    ds = ((hd + 2) * U + stored + 2 * operand) * big_s
    eps_p = 2 * ds + (2 * big_s * math.log2(math.e) + APPROX) * U
    vmax = np.abs(v[:span]).max()
    return (2 * eps_p + (span + 4) * U + stored + operand) * vmax


def attention_ref(q, k, v, rows: int, p: int, hd: int, scale: float) -> np.ndarray:
    spec = Attention(rows, HEADS, KV, hd, CACHE, scale)
    return ref.attention(spec, [q.reshape(rows, -1), k, v], p)


def caches(rng, hd: int, dtype):
    """K and V caches of CACHE rows (f64 values, and the device tensors storing them in `dtype`), the two kv
    heads far apart (head 1 shifted) so a query reading the wrong head is caught."""
    k, v = f32(rng, CACHE, KV * hd), f32(rng, CACHE, KV * hd)
    v[:, hd:] += 4.0
    return k, v, dev(k, dtype), dev(v, dtype)


@pytest.mark.parametrize("hd", [16, 32, 64, 80])  # 80: two heads a block (whole 32-value blocks together)
@pytest.mark.parametrize("p", [0, 17, CACHE - 1])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits, merge_batch, per_block", [(1, 16, None), (4, 16, None), (4, 2, None), (4, 2, 1)])
@pytest.mark.parametrize("dependent", [False, True], ids=["plain", "dependent"])
def test_flash_decode_matches_cpu(hd, p, cache_dtype, splits, merge_batch, per_block, dependent):
    """Also as a dependent launch, whose blocks read their first tile before the wait and the position's row
    after it."""
    with pdl.dependent_launches(dependent):
        _flash_decode_matches_cpu(hd, p, cache_dtype, splits, merge_batch, per_block)


def _flash_decode_matches_cpu(hd, p, cache_dtype, splits, merge_batch, per_block):
    rng = np.random.default_rng(hd * 100 + p)
    scale = hd**-0.5
    q = f32(rng, 1, HEADS * hd)
    k, v, kc, vc = caches(rng, hd, cache_dtype)
    out = torch.empty(1, HEADS * hd, device=DEVICE)
    scratch = attention.decode_scratch(HEADS, hd, CACHE, DEVICE, splits=splits)
    # tiles of 8 rows and chunks of at least 8: a 40-row cache reaches four splits, some empty at small p
    # a merge of two splits at a time reaches a second batch
    shape = dict(heads=HEADS, kv_heads=KV, hd=hd, scale=scale, splits=splits, tile_rows=8, min_chunk=8)
    shape |= dict(merge_batch=merge_batch, heads_per_block=per_block)
    attention.flash_decode(dev(q), kc, vc, pos_of(p), out, scratch=scratch, **shape)
    # against the unrounded caches: an f16 cache's rounding is part of the bound (2^-11 per stored value)
    stored = U16 if cache_dtype == torch.float16 else 0.0
    want = attention_ref(q, k, v, 1, p, hd, scale)
    within(host(out), want, attention_bound(q, k, v, 1, p + 1, hd, scale, stored)[:, None], "decode")
    if splits > 1:
        assert not host(scratch[-HEADS:].view(torch.int32)).any(), "the merge left a counter armed"
        # a replayed graph: the same launch at the next position, read from the same pos tensor
        pos = pos_of(p)
        attention.flash_decode(dev(q), kc, vc, pos, out, scratch=scratch, **shape)
        again = host(out)
        pos.fill_(max(0, p - 5))
        attention.flash_decode(dev(q), kc, vc, pos, out, scratch=scratch, **shape)
        want = attention_ref(q, k, v, 1, max(0, p - 5), hd, scale)
        within(host(out), want, attention_bound(q, k, v, 1, max(0, p - 5) + 1, hd, scale, stored)[:, None], "at p-5")
        np.testing.assert_allclose(again, attention_ref(q, k, v, 1, p, hd, scale), atol=1e-2)


def test_flash_decode_reads_each_groups_kv_head():
    """Query heads 0, 1 read kv head 0 and heads 2, 3 kv head 1 (h // group), not h % kv_heads."""
    rng = np.random.default_rng(3)
    hd, p = 32, 30
    q = f32(rng, 1, HEADS * hd)
    k, v, kc, vc = caches(rng, hd, torch.float32)
    out = torch.empty(1, HEADS * hd, device=DEVICE)
    scratch = attention.decode_scratch(HEADS, hd, CACHE, DEVICE)  # the plan's splits, whatever they are
    attention.flash_decode(dev(q), kc, vc, pos_of(p), out, heads=HEADS, kv_heads=KV, hd=hd, scale=0.2, scratch=scratch)
    got = host(out).reshape(HEADS, hd)
    means = got.mean(axis=1)  # values of kv head 1 sit 4.0 above kv head 0's
    assert means[2] - means[0] > 3 and means[3] - means[1] > 3
    want = attention_ref(q, k, v, 1, p, hd, 0.2)
    within(got.reshape(1, -1), want, attention_bound(q, k, v, 1, p + 1, hd, 0.2, 0.0)[:, None], "grouping")


@pytest.mark.parametrize("hd", [16, 32, 48, 64, 80])  # 48 and 80: heads padded to a power of two in the tile
@pytest.mark.parametrize("p", [0, 21])
@pytest.mark.parametrize("operands", [torch.float32, torch.float16])
def test_flash_prefill_matches_cpu(hd, p, operands):
    rng = np.random.default_rng(hd + 7 * p)
    rows, scale = 7, hd**-0.5
    q = f32(rng, rows, HEADS * hd)
    if operands == torch.float16:  # f16 operands: q as stored in f16 is what the reference reads
        q = q.astype(np.float16).astype(np.float64)
    k, v, kc, vc = caches(rng, hd, operands)
    k, v = host(kc), host(vc)  # the stored values (exact for f32; the reference reads the f16 ones)
    out = torch.empty(rows, HEADS * hd, device=DEVICE)
    # 16-row tiles: several query tiles, key tiles wholly below the diagonal and tiles across it
    attention_prefill.flash_prefill(
        dev(q, operands), kc, vc, pos_of(p), out, rows=rows, heads=HEADS, kv_heads=KV, hd=hd, scale=scale,
        block_m=16, block_n=16,
    )  # fmt: skip
    want = attention_ref(q, k, v, rows, p, hd, scale)
    # f16 operands: q and k are already f16 values; the weights are rounded to f16 for the second product
    operand = U16 if operands == torch.float16 else TF32X3
    within(host(out), want, attention_bound(q, k, v, rows, p + rows, hd, scale, 0.0, operand)[:, None], "prefill")


def test_flash_prefill_rounds_an_f32_query_in_the_kernel_under_f16_operands():
    """`f16_ops` (the int8 numerics' attention) multiplies an f32 query on the f16 path: the same sums, bit
    for bit, as a query stored in f16, and within the f16 operands' bound of the reference."""
    rng = np.random.default_rng(12)
    rows, hd, p, scale = 7, 32, 21, 32**-0.5
    q = f32(rng, rows, HEADS * hd)
    q16 = q.astype(np.float16).astype(np.float64)
    _, _, kc, vc = caches(rng, hd, torch.float16)
    k, v = host(kc), host(vc)
    shape = dict(rows=rows, heads=HEADS, kv_heads=KV, hd=hd, scale=scale, block_m=16, block_n=16)
    rounded, stored = (torch.empty(rows, HEADS * hd, device=DEVICE) for _ in range(2))
    attention_prefill.flash_prefill(dev(q), kc, vc, pos_of(p), rounded, f16_ops=True, **shape)
    attention_prefill.flash_prefill(dev(q16, torch.float16), kc, vc, pos_of(p), stored, **shape)
    np.testing.assert_array_equal(host(rounded), host(stored))
    bound = attention_bound(q16, k, v, rows, p + rows, hd, scale, 0.0, U16)
    within(host(rounded), attention_ref(q16, k, v, rows, p, hd, scale), bound[:, None], "prefill")


@pytest.mark.parametrize("hd", [64, 96])  # 96: three blocks a head in a tile of 128, the padding's not stored
def test_flash_prefill_writes_its_int8_form(hd):
    # AttnOutputQuant of a chunk: the launch's own output, quantized as `quant.quantize` does, bit for bit
    rng = np.random.default_rng(13)
    rows, p, scale = 7, 21, hd**-0.5
    q = f32(rng, rows, HEADS * hd)
    _, _, kc, vc = caches(rng, hd, torch.float16)
    out = torch.empty(rows, HEADS * hd, device=DEVICE)
    q8 = quant.empty_q8(rows, HEADS * hd, DEVICE)
    shape = dict(rows=rows, heads=HEADS, kv_heads=KV, hd=hd, scale=scale, block_m=16, block_n=16)
    attention_prefill.flash_prefill(dev(q), kc, vc, pos_of(p), out, f16_ops=True, out_q8=q8, **shape)
    codes, d, s = quant.quantize_reference(out.cpu().numpy())
    assert np.array_equal(q8.q.cpu().numpy(), codes) and np.array_equal(q8.d.cpu().numpy(), d)
    assert np.array_equal(q8.s.cpu().numpy(), s)


def test_flash_prefill_default_tiles_and_row_pitch():
    rng = np.random.default_rng(9)
    rows, hd, p, scale = 5, 32, 9, 0.15
    merged = f32(rng, rows, 2 * HEADS * hd)  # q read in place from a wider row
    k, v, kc, vc = caches(rng, hd, torch.float32)
    out = torch.empty(rows, HEADS * hd, device=DEVICE)
    q = dev(merged)[:, : HEADS * hd]
    attention_prefill.flash_prefill(q, kc, vc, pos_of(p), out, rows=rows, heads=HEADS, kv_heads=KV, hd=hd, scale=scale)
    want = attention_ref(merged[:, : HEADS * hd], k, v, rows, p, hd, scale)
    bound = attention_bound(merged[:, : HEADS * hd], k, v, rows, p + rows, hd, scale, 0.0, TF32X3)
    within(host(out), want, bound[:, None], "prefill")


def real_ref_attention(q, k, v, rows: int, p: int, scale: float) -> np.ndarray:
    spec = Attention(rows, R_HEADS, R_KV, R_HD, R_CACHE, scale)
    return ref.attention(spec, [q, k, v], p)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("p", [0, 1000, R_CACHE - 1])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
def test_cuda_flash_decode_real_shape(p, cache_dtype):
    rng = np.random.default_rng(p)
    scale = R_HD**-0.5
    q = f32(rng, 1, R_HEADS * R_HD)
    k, v = f32(rng, R_CACHE, R_KV * R_HD), f32(rng, R_CACHE, R_KV * R_HD)
    out = torch.empty(1, R_HEADS * R_HD, device=DEVICE)
    scratch = attention.decode_scratch(R_HEADS, R_HD, R_CACHE, DEVICE)
    shape = dict(heads=R_HEADS, kv_heads=R_KV, hd=R_HD, scale=scale)
    attention.flash_decode(dev(q), dev(k, cache_dtype), dev(v, cache_dtype), pos_of(p), out, scratch=scratch, **shape)
    stored = U16 if cache_dtype == torch.float16 else 0.0
    bound = attention_bound(q, k, v, 1, p + 1, R_HD, scale, stored)
    within(host(out), real_ref_attention(q, k, v, 1, p, scale), bound[:, None], "decode")
    assert attention.decode_plan(R_HEADS, R_KV, R_HD, R_CACHE).splits > 1


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("operands", [torch.float16, torch.float32])
def test_cuda_flash_prefill_real_shape(operands):
    rng = np.random.default_rng(8)
    rows, p, scale = 128, 1000, R_HD**-0.5
    q = f32(rng, rows, R_HEADS * R_HD)
    if operands == torch.float16:
        q = q.astype(np.float16).astype(np.float64)
    kc, vc = dev(f32(rng, R_CACHE, R_KV * R_HD), operands), dev(f32(rng, R_CACHE, R_KV * R_HD), operands)
    k, v = host(kc), host(vc)
    out = torch.empty(rows, R_HEADS * R_HD, device=DEVICE)
    attention_prefill.flash_prefill(
        dev(q, operands), kc, vc, pos_of(p), out, rows=rows, heads=R_HEADS, kv_heads=R_KV, hd=R_HD, scale=scale
    )
    operand = U16 if operands == torch.float16 else TF32X3
    bound = attention_bound(q, k, v, rows, p + rows, R_HD, scale, 0.0, operand)
    within(host(out), real_ref_attention(q, k, v, rows, p, scale), bound[:, None], "prefill")


# 48, 80: a head a block (an odd group's), a 32-value block two blocks share (a seam) quantized by the later;
# two heads a block (the plan's in an even group) are whole blocks, quantized by the block alone. Heads of 8 or
# 16 a block: a 32-value block four or two blocks share
@pytest.mark.parametrize(
    "hd, per_block", [(32, None), (64, None), (48, 1), (80, 1), (48, None), (80, None), (8, 1), (16, 1), (16, None)]
)
@pytest.mark.parametrize("splits", [1, 4])
def test_flash_decode_writes_its_output_quantized(hd, per_block, splits):
    # with out_q8 the output is the same f32 row, and its int8 form is quant.quantize_reference's, bit for bit,
    # from the one split's store and from the merge's; the launch leaves its counters at zero, so the next
    # (a replayed graph's) gives the same
    from fuselane.lanes.cuda.triton import quant

    rng = np.random.default_rng(hd + splits)
    q = f32(rng, 1, HEADS * hd)
    _, _, kc, vc = caches(rng, hd, torch.float16)
    shape = dict(heads=HEADS, kv_heads=KV, hd=hd, scale=hd**-0.5, splits=splits, tile_rows=8, min_chunk=8)
    shape |= dict(heads_per_block=per_block)
    plain, out = torch.empty(1, HEADS * hd, device=DEVICE), torch.empty(1, HEADS * hd, device=DEVICE)
    out_q8 = quant.empty_q8(1, HEADS * hd, DEVICE)
    attention.flash_decode(dev(q), kc, vc, pos_of(CACHE - 1), plain, scratch=None if splits == 1 else
                           attention.decode_scratch(HEADS, hd, CACHE, DEVICE, splits=splits), **shape)  # fmt: skip
    scratch = attention.decode_scratch(HEADS, hd, CACHE, DEVICE, splits=splits)
    for _ in range(2):
        attention.flash_decode(dev(q), kc, vc, pos_of(CACHE - 1), out, scratch=scratch, out_q8=out_q8, **shape)
        assert torch.equal(out, plain)
        codes, d, s = quant.quantize_reference(out.cpu().numpy())
        assert np.array_equal(out_q8.q.cpu().numpy(), codes)
        assert np.array_equal(out_q8.d.cpu().numpy(), d) and np.array_equal(out_q8.s.cpu().numpy(), s)
        counters = scratch[HEADS * splits * (hd + 2) :].view(torch.int32)
        assert not host(counters).any(), "the launch left a counter armed"
