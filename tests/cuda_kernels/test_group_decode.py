"""The packed decode attention (`attention/group_decode.py`, AttnGqaRowPacking) against the cpu lane in f64.

Without a GPU the kernel runs in Triton's interpreter at small shapes (groups of 2, 3 and 7 query heads, heads
of 16-64 values, a 40-row cache in tiles of 16 rows); the `cuda` test runs the 7B's and the 8B's heads over
4,096 rows. Tolerances are `test_attention_kernels.attention_bound`'s: the kernel rounds the scaled query,
the keys, the values and the softmax weights to f16 (2^-11 each, relative), so a cache in f32 is rounded as an
f16 one is stored.
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
from fuselane.lanes.cuda.plan import attn_kernels  # noqa: E402
from fuselane.lanes.cuda.triton import pdl, quant  # noqa: E402
from fuselane.lanes.cuda.triton.attention import decode as attention  # noqa: E402
from fuselane.lanes.cuda.triton.attention import group_decode  # noqa: E402
from tests.cuda_kernels.test_attention_kernels import attention_bound  # noqa: E402
from tests.cuda_kernels.test_norm_rope_attention import (  # noqa: E402
    APPROX,
    DEVICE,
    U16,
    U,
    dev,
    f32,
    host,
    pos_of,
    within,
)

CACHE = 40
TILE = 16  # a 40-row cache reaches three tiles, and splits of one tile each


def reference(q, k, v, heads: int, kv: int, hd: int, p: int, scale: float, cache: int = CACHE) -> np.ndarray:
    return ref.attention(Attention(1, heads, kv, hd, cache, scale), [q, k, v], p)


def case(rng, heads: int, kv: int, hd: int, cache_dtype, cache: int = CACHE):
    """A query and caches (f64 values and their device tensors), each kv head's values shifted apart so a
    query reading another group's head is caught."""
    q = f32(rng, 1, heads * hd)
    k, v = f32(rng, cache, kv * hd), f32(rng, cache, kv * hd)
    v += np.repeat(4.0 * np.arange(kv), hd)[None, :]
    return q, k, v, dev(k, cache_dtype), dev(v, cache_dtype)


def packed(q, kc, vc, p, out, heads, kv, hd, scale, **kw):
    scratch = attention.decode_scratch(heads, hd, kc.shape[0], DEVICE, splits=kw.get("splits"))
    attention.flash_decode(dev(q), kc, vc, pos_of(p), out, heads=heads, kv_heads=kv, hd=hd, scale=scale,
                           scratch=scratch, f16_ops=True, **kw)  # fmt: skip
    return scratch


@pytest.mark.parametrize("heads, kv, hd", [(4, 2, 16), (6, 2, 32), (7, 1, 64)], ids=["g2", "g3", "g7"])
@pytest.mark.parametrize("p", [0, 17, CACHE - 1])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits, merge_batch", [(1, None), (4, None), (4, 1)], ids=["one", "at-once", "batched"])
@pytest.mark.parametrize("dependent", [False, True], ids=["plain", "dependent"])
def test_packed_decode_matches_cpu(heads, kv, hd, p, cache_dtype, splits, merge_batch, dependent):
    """Every group size's padding (2, 3 and 7 heads in 16 product rows, 2, 4 and 8 merge rows), one split
    writing its output, several merged at once or one at a time, and as a dependent launch (the first tile read
    before the wait, the position's row after it)."""
    rng = np.random.default_rng(hd * 100 + p + heads)
    scale = hd**-0.5
    q, k, v, kc, vc = case(rng, heads, kv, hd, cache_dtype)
    out = torch.empty(1, heads * hd, device=DEVICE)
    with pdl.dependent_launches(dependent):
        scratch = packed(q, kc, vc, p, out, heads, kv, hd, scale, splits=splits, tile_rows=TILE,
                         merge_batch=merge_batch)  # fmt: skip
    bound = attention_bound(q, k, v, 1, p + 1, hd, scale, U16, U16)
    within(host(out), reference(q, k, v, heads, kv, hd, p, scale), bound[:, None], "packed decode")
    if splits > 1:
        assert not host(scratch[-heads:].view(torch.int32)).any(), "the merge left a counter armed"


def test_packed_decode_replays_at_another_position():
    """The splits' shares come from the position in the kernel: one scratch and launch shape, read again at a
    shorter span (a replayed graph), gives that span's attention."""
    rng = np.random.default_rng(5)
    heads, kv, hd, scale = 6, 2, 32, 32**-0.5
    q, k, v, kc, vc = case(rng, heads, kv, hd, torch.float16)
    out = torch.empty(1, heads * hd, device=DEVICE)
    scratch = attention.decode_scratch(heads, hd, CACHE, DEVICE, splits=4)
    shape = dict(heads=heads, kv_heads=kv, hd=hd, scale=scale, scratch=scratch, f16_ops=True, splits=4, tile_rows=TILE)
    pos = pos_of(CACHE - 1)
    attention.flash_decode(dev(q), kc, vc, pos, out, **shape)
    for p in (CACHE - 1, 20, 3):
        pos.fill_(p)
        attention.flash_decode(dev(q), kc, vc, pos, out, **shape)
        bound = attention_bound(q, k, v, 1, p + 1, hd, scale, U16, U16)
        within(host(out), reference(q, k, v, heads, kv, hd, p, scale), bound[:, None], f"at {p}")


def test_packed_decode_gates_and_quantizes_its_output():
    """AttnOutputGate and AttnOutputQuant in the store: the gated output is the plain one times each head's
    sigmoid, and its int8 form is `quant.quantize`'s of it, bit for bit (one split and merged)."""
    rng = np.random.default_rng(6)
    heads, kv, hd, scale = 4, 2, 32, 32**-0.5
    q, _, _, kc, vc = case(rng, heads, kv, hd, torch.float16)
    gate = dev(f32(rng, heads, hd))
    for splits in (1, 4):
        plain, gated = (torch.empty(1, heads * hd, device=DEVICE) for _ in range(2))
        q8 = quant.empty_q8(1, heads * hd, DEVICE)
        packed(q, kc, vc, CACHE - 1, plain, heads, kv, hd, scale, splits=splits, tile_rows=TILE)
        packed(q, kc, vc, CACHE - 1, gated, heads, kv, hd, scale, splits=splits, tile_rows=TILE, gate=gate,
               out_q8=(q8.q, q8.d, q8.s))  # fmt: skip
        want = host(plain) / (1 + np.exp(-host(gate).reshape(1, -1)))
        # the same output's bits times a sigmoid: its exp (APPROX), the add, the divide and the product
        np.testing.assert_allclose(host(gated), want, rtol=(APPROX + 4) * U, atol=0)
        codes, d, s = quant.quantize_reference(gated.cpu().numpy())
        assert np.array_equal(q8.q.cpu().numpy(), codes) and np.array_equal(q8.d.cpu().numpy(), d)
        assert np.array_equal(q8.s.cpu().numpy(), s)


@pytest.mark.parametrize("heads, kv", [(2, 2), (4, 2), (6, 2)], ids=["g1", "g2", "g3"])
@pytest.mark.parametrize("splits", [1, 4])
def test_packed_decode_quantizes_heads_narrower_than_a_block(heads, kv, splits):
    """Heads of 16 values: a group of two is whole 32-value blocks, quantized by its block alone; a group of one
    or three shares a block with the next group's (a seam), quantized by the later of the two to store. The
    int8 form is `quant.quantize`'s of the output, bit for bit, and the launch leaves its counters at zero, so
    a second (a replayed graph's) gives the same."""
    rng = np.random.default_rng(heads * 10 + splits)
    hd = 16
    q, _, _, kc, vc = case(rng, heads, kv, hd, torch.float16)
    plain, out = (torch.empty(1, heads * hd, device=DEVICE) for _ in range(2))
    packed(q, kc, vc, CACHE - 1, plain, heads, kv, hd, hd**-0.5, splits=splits, tile_rows=TILE)
    q8 = quant.empty_q8(1, heads * hd, DEVICE)
    scratch = attention.decode_scratch(heads, hd, kc.shape[0], DEVICE, splits=splits)
    shape = dict(heads=heads, kv_heads=kv, hd=hd, scale=hd**-0.5, scratch=scratch, f16_ops=True, splits=splits)
    for _ in range(2):
        attention.flash_decode(dev(q), kc, vc, pos_of(CACHE - 1), out, tile_rows=TILE, out_q8=(q8.q, q8.d, q8.s),
                               **shape)  # fmt: skip
        assert torch.equal(out, plain)
        codes, d, s = quant.quantize_reference(out.cpu().numpy())
        assert np.array_equal(q8.q.cpu().numpy(), codes) and np.array_equal(q8.d.cpu().numpy(), d)
        assert np.array_equal(q8.s.cpu().numpy(), s)
        assert not host(scratch[heads * splits * (hd + 2) :].view(torch.int32)).any(), "a counter left armed"


def test_a_query_past_f16s_range_stays_finite():
    """The query is scaled by the softmax's scale (and log2 e) before its rounding to f16: values up to 2e5,
    past f16's 65504, give the reference's output within the bound, not an overflow."""
    rng = np.random.default_rng(7)
    heads, kv, hd, p = 4, 2, 64, CACHE - 1
    scale = hd**-0.5
    q, k, v, kc, vc = case(rng, heads, kv, hd, torch.float16)
    q = q / np.abs(q).max() * 2e5
    out = torch.empty(1, heads * hd, device=DEVICE)
    packed(q, kc, vc, p, out, heads, kv, hd, scale, splits=4, tile_rows=TILE)
    bound = attention_bound(q, k, v, 1, p + 1, hd, scale, U16, U16)
    within(host(out), reference(q, k, v, heads, kv, hd, p, scale), bound[:, None], "a large query")


def test_only_power_of_two_heads_pack():
    """tl.dot's sides: heads of a power of two of at least 16 values pack; others (a head of 80 or of 8) take
    the CUDA-core kernel even where asked."""
    assert group_decode.rows_packed(64) and group_decode.rows_packed(256)
    assert not group_decode.rows_packed(80) and not group_decode.rows_packed(8)


def test_the_plans_splits_are_powers_of_two_within_the_chip():
    """`attn_group_splits`: a power of two, no more than `ATTN_GROUP_MOST_SPLITS`, a tile a split at least, and
    within `ATTN_GROUP_WAVES` blocks a SM."""
    for kv in (1, 2, 4, 8, 16, 64):
        for span in (1, 64, 65, 1000, 4096, 131072):
            s = attn_kernels.attn_group_splits(kv, span, 132)
            assert s & (s - 1) == 0 and 1 <= s <= attn_kernels.ATTN_GROUP_MOST_SPLITS
            assert s <= math.ceil(span / attn_kernels.ATTN_GROUP_MIN_CHUNK)
            assert s == 1 or kv * s <= attn_kernels.ATTN_GROUP_WAVES * 132


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("heads, kv", [(28, 4), (32, 8)], ids=["7b", "8b"])
@pytest.mark.parametrize("p", [0, 1000, 4095])
def test_cuda_packed_decode_real_shapes(heads, kv, p):
    rng = np.random.default_rng(p + heads)
    hd, cache, scale = 128, 4096, 128**-0.5
    q, k, v, kc, vc = case(rng, heads, kv, hd, torch.float16, cache)
    out = torch.empty(1, heads * hd, device=DEVICE)
    packed(q, kc, vc, p, out, heads, kv, hd, scale)  # the plan's splits, tiles and warps
    bound = attention_bound(q, k, v, 1, p + 1, hd, scale, U16, U16)
    within(host(out), reference(q, k, v, heads, kv, hd, p, scale, cache), bound[:, None], "packed decode")
    assert group_decode.group_plan(heads, kv, cache, 132).splits > 1
