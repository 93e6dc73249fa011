"""The paged decode attention, the pool's row store and the rotations of a batch's rows (each at its own
position) against the cpu lane's NumPy kernels in f64.

Each row of a batch attends its own cache rows, which lie in scattered blocks of one pool found through its
table: the reference gathers them into a contiguous cache and runs the cpu lane's attention over it. Bounds are
`attention_bound`'s (derived in test_attention_kernels), the reference reading the unrounded rows; tiny
shapes (4 query heads over 2, blocks of 4 rows), run in Triton's interpreter without a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from test_attention_kernels import attention_bound  # noqa: E402
from test_norm_rope_attention import (  # noqa: E402
    EPS,
    HEADS,
    KV,
    QWEN_BASE,
    U16,
    dev,
    f32,
    host,
    rope_bound,
    weighted_norm,
    within,
)

from fuselane.graph.ops import Attention, Rope  # noqa: E402
from fuselane.lanes.cpu import kernels as ref  # noqa: E402
from fuselane.lanes.cuda.triton import pdl, quant, rope  # noqa: E402
from fuselane.lanes.cuda.triton.attention import paged  # noqa: E402

BLOCK = 4
POOL_BLOCKS = 12
LENS = [1, 7, 13]  # one row, one block and a part, several blocks


def _tables(rng: np.random.Generator) -> list[list[int]]:
    """Each row's blocks, scattered over the pool and disjoint."""
    ids = rng.permutation(POOL_BLOCKS)
    out, at = [], 0
    for n in LENS:
        need = -(-n // BLOCK)
        out.append([int(b) for b in ids[at : at + need]])
        at += need
    return out


def _padded(tables: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev(np.zeros(1)).device)


@pytest.mark.parametrize("hd", [16, 32])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_paged_decode_matches_cpu(hd, cache_dtype):
    rng = np.random.default_rng(hd)
    rows, scale = len(LENS), hd**-0.5
    k_pool, v_pool = f32(rng, POOL_BLOCKS * BLOCK, KV * hd), f32(rng, POOL_BLOCKS * BLOCK, KV * hd)
    v_pool[:, hd:] += 4.0  # the kv heads far apart: a query reading the wrong head is caught
    tables = _tables(rng)
    q = f32(rng, rows, HEADS * hd)
    out = torch.zeros(rows, HEADS * hd, device=q_device())
    lens = torch.tensor(LENS, dtype=torch.int32, device=q_device())
    paged.paged_decode(
        dev(q), dev(k_pool, cache_dtype), dev(v_pool, cache_dtype), _padded(tables, 5), lens, out,
        heads=HEADS, kv_heads=KV, hd=hd, scale=scale, block_size=BLOCK,
    )  # fmt: skip
    stored = U16 if cache_dtype == torch.float16 else 0.0
    for i, (n, table) in enumerate(zip(LENS, tables, strict=True)):
        at = np.concatenate([np.arange(b * BLOCK, (b + 1) * BLOCK) for b in table])[:n]
        k, v = k_pool[at], v_pool[at]
        spec = Attention(1, HEADS, KV, hd, n, scale)
        want = ref.attention(spec, [q[i : i + 1], k, v], n - 1)
        bound = attention_bound(q[i : i + 1], k, v, 1, n, hd, scale, stored)[:, None]
        within(host(out)[i : i + 1], want, bound, f"row {i}")


# heads of 48 and 80 in a group of two: two heads a program, whole 32-value blocks together; in a group of three:
# a head a program, a 32-value block two programs share (a seam) quantized by the later; heads of 16 two a
# program, heads of 8 a head a program, four programs to a block
@pytest.mark.parametrize(
    "hd, heads", [(32, HEADS), (48, HEADS), (80, HEADS), (48, 3 * KV), (80, 3 * KV), (16, HEADS), (8, HEADS)]
)
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode_writes_int8_form(hd, heads, splits):
    """With `out_q8` each row's output is also written as int8 activations, `quant.quantize_reference`'s bit for
    bit, from one split's store and from the merge's; a launch leaves its seam counters at zero, so a second
    gives the same."""
    rng = np.random.default_rng(5 + hd)
    rows = len(LENS)
    k_pool, v_pool = f32(rng, POOL_BLOCKS * BLOCK, KV * hd), f32(rng, POOL_BLOCKS * BLOCK, KV * hd)
    out = torch.zeros(rows, heads * hd, device=q_device())
    q8 = quant.empty_q8(rows, heads * hd, q_device())
    lens = torch.tensor(LENS, dtype=torch.int32, device=q_device())
    shape = dict(heads=heads, kv_heads=KV, hd=hd, scale=0.25, block_size=BLOCK, out_q8=q8)
    if splits > 1:
        shape |= dict(SPLIT_SHAPE, splits=splits)
    plan = paged.paged_plan(rows, heads, KV, 5 * BLOCK, sms=1, splits=splits, hd=hd)
    # a head a program where heads are whole blocks, or where no count of a group's heads is (three; two of 8)
    assert (plan.heads_per_block == 1) is (hd % 32 == 0 or heads // KV == 3 or heads // KV * hd % 32 != 0)
    need = paged.paged_scratch_size(plan, rows, heads, hd, quantized=True)
    assert bool(need) == (splits > 1 or plan.heads_per_block * hd % 32 != 0)
    scratch = torch.zeros(max(1, need), device=q_device())
    q, tables = dev(f32(rng, rows, heads * hd)), _padded(_tables(rng), 5)
    for _ in range(2):
        paged.paged_decode(q, dev(k_pool), dev(v_pool), tables, lens, out, scratch=scratch, **shape)
        codes, d, s = quant.quantize_reference(out.cpu().numpy())
        assert np.array_equal(q8.q.cpu().numpy(), codes)
        assert np.array_equal(q8.d.cpu().numpy(), d) and np.array_equal(q8.s.cpu().numpy(), s)
        counters = scratch[rows * heads * plan.splits * (hd + 2) : need].view(torch.int32)
        assert not host(counters).any(), "a launch left a counter armed"


# Several splits of short spans: tiles of two blocks, chunks of at least a tile, four splits a row (merged two at
# a time). Lengths: one row, a block's end, several blocks (two splits, the second part of a tile), and one much
# longer row whose span takes all four splits, its last one short; then the same launch again at other lengths
# over other tables (three splits; two, the second of one row), as a captured graph replays it.
SPLIT_LENS = ([1, BLOCK, 13, 61], [6, 33, 8, 2 * BLOCK + 1])
SPLIT_POOL = 24  # blocks: the widest step's 1 + 1 + 4 + 16 and one spare
SPLIT_SHAPE = dict(splits=4, tile_rows=2 * BLOCK, min_chunk=2 * BLOCK, merge_batch=2)


def _disjoint_tables(rng: np.random.Generator, lens: list[int]) -> list[list[int]]:
    ids, out, at = rng.permutation(SPLIT_POOL), [], 0
    for n in lens:
        need = -(-n // BLOCK)
        out.append([int(b) for b in ids[at : at + need]])
        at += need
    return out


def _gathered_ref(q, k_pool, v_pool, lens, tables, hd, scale, stored, what):
    """Each row's output from the cpu lane's attention over its blocks gathered in order, and its bound."""
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        at = np.concatenate([np.arange(b * BLOCK, (b + 1) * BLOCK) for b in table])[:n]
        k, v = k_pool[at], v_pool[at]
        want = ref.attention(Attention(1, HEADS, KV, hd, n, scale), [q[i : i + 1], k, v], n - 1)
        yield want, attention_bound(q[i : i + 1], k, v, 1, n, hd, scale, stored)[:, None], f"{what} row {i}"


@pytest.mark.parametrize("dependent", [False, True], ids=["plain", "dependent"])
def test_paged_decode_splits_ragged_rows_and_replays(dependent):
    """A row's span split over four programs, each taking whole tiles of two blocks gathered by their ids, the
    last to finish merging: every row within the contract's attention bound of the cpu lane in f64 (f16 pool),
    the rows' counters back at zero after each launch, the second launch right at its own lengths. Also as a
    dependent launch, whose programs read their first tile before the wait and the row's last row after it."""
    rng = np.random.default_rng(11)
    hd, rows = 32, len(SPLIT_LENS[0])
    scale, width = hd**-0.5, 16
    k_pool, v_pool = f32(rng, SPLIT_POOL * BLOCK, KV * hd), f32(rng, SPLIT_POOL * BLOCK, KV * hd)
    v_pool[:, hd:] += 4.0  # the kv heads far apart: a query reading the wrong head is caught
    kd, vd = dev(k_pool, torch.float16), dev(v_pool, torch.float16)
    plan = paged.paged_plan(rows, HEADS, KV, width * BLOCK, sms=1, splits=4)
    scratch = torch.zeros(paged.paged_scratch_size(plan, rows, HEADS, hd), device=q_device())
    counters = scratch[-rows * plan.head_blocks :].view(torch.int32)
    out = torch.zeros(rows, HEADS * hd, device=q_device())
    for step, lens in enumerate(SPLIT_LENS):
        q, tables = f32(rng, rows, HEADS * hd), _disjoint_tables(rng, lens)
        lens_d = torch.tensor(lens, dtype=torch.int32, device=q_device())
        with pdl.dependent_launches(dependent):
            paged.paged_decode(
                dev(q), kd, vd, _padded(tables, width), lens_d, out, heads=HEADS, kv_heads=KV, hd=hd, scale=scale,
                block_size=BLOCK, scratch=scratch, **SPLIT_SHAPE,
            )  # fmt: skip
        got = host(out)
        for i, (want, bound, what) in enumerate(_gathered_ref(q, k_pool, v_pool, lens, tables, hd, scale, U16, step)):
            within(got[i : i + 1], want, bound, f"launch {what}")
        assert not host(counters).any(), f"launch {step} left a row's counter armed"


@pytest.mark.parametrize("hd", [32, 48, 80])
def test_paged_decode_merged_rows_write_int8_form(hd):
    """A merged row's output is written as int8 activations too: within half a code of its f32 output (the
    seams between heads of 48 and 80 too)."""
    rng = np.random.default_rng(12)
    lens = SPLIT_LENS[0]
    rows, width = len(lens), 16
    k_pool, v_pool = f32(rng, SPLIT_POOL * BLOCK, KV * hd), f32(rng, SPLIT_POOL * BLOCK, KV * hd)
    plan = paged.paged_plan(rows, HEADS, KV, width * BLOCK, sms=1, splits=4, hd=hd)
    scratch = torch.zeros(paged.paged_scratch_size(plan, rows, HEADS, hd, quantized=True), device=q_device())
    out = torch.zeros(rows, HEADS * hd, device=q_device())
    q8 = quant.empty_q8(rows, HEADS * hd, q_device())
    paged.paged_decode(
        dev(f32(rng, rows, HEADS * hd)), dev(k_pool), dev(v_pool), _padded(_disjoint_tables(rng, lens), width),
        torch.tensor(lens, dtype=torch.int32, device=q_device()), out, heads=HEADS, kv_heads=KV, hd=hd,
        scale=0.25, block_size=BLOCK, out_q8=q8, scratch=scratch, **SPLIT_SHAPE,
    )  # fmt: skip
    got, back = host(out), host(quant.dequantize(q8))
    step = np.abs(got).reshape(rows, -1, 32).max(axis=2, keepdims=True) / 127
    assert np.all(np.abs(back - got).reshape(rows, -1, 32) <= step / 2 * (1 + 1e-5) + 1e-30)


def test_paged_plan_splits_only_where_the_rows_leave_the_chip_idle():
    """The splits follow the rows, heads and SMs (never the lengths): a small batch of a long table splits, a
    batch whose head blocks fill the chip does not, a short table's span is not cut under the fewest rows."""
    small = paged.paged_plan(8, 14, 2, 1024, sms=132)  # Qwen2.5-0.5B's heads, eight rows
    assert small.head_blocks == 14 and small.splits > 1
    assert paged.paged_plan(64, 32, 8, 1024, sms=132).splits == 1  # 2,048 head blocks on 132 SMs
    assert paged.paged_plan(8, 14, 2, 32, sms=132).splits == 1  # one tile's rows
    assert paged.paged_plan(8, 14, 2, 1024, sms=132, splits=3).splits == 3


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_store_kv_lands_rows_at_their_slots(cache_dtype):
    rng = np.random.default_rng(2)
    k, v = f32(rng, 3, 32), f32(rng, 3, 48)  # keys and values of different widths
    k_pool = torch.zeros(20, 32, dtype=cache_dtype, device=q_device())
    v_pool = torch.zeros(20, 48, dtype=cache_dtype, device=q_device())
    slots = torch.tensor([17, 2, 9], dtype=torch.int32, device=q_device())
    paged.store_kv(dev(k), dev(v), k_pool, v_pool, slots)
    kp, vp = host(k_pool), host(v_pool)
    rounded = np.float16 if cache_dtype == torch.float16 else np.float32
    for i, s in enumerate([17, 2, 9]):
        np.testing.assert_array_equal(kp[s], k[i].astype(rounded))
        np.testing.assert_array_equal(vp[s], v[i].astype(rounded))
    others = np.setdiff1d(np.arange(20), [17, 2, 9])
    assert not kp[others].any() and not vp[others].any()


POSITIONS = [13, 0, 5]  # each row its own sequence's position


def _turned(x: np.ndarray, heads: int, hd: int, w: np.ndarray | None) -> np.ndarray:
    """The cpu lane's rotation of a batch's rows, each at its own position (normed first where `w`)."""
    x = weighted_norm(x, w, hd) if w is not None else x
    return ref.rope(Rope(len(POSITIONS), heads, hd, QWEN_BASE, batched=True), [x], np.asarray(POSITIONS))


@pytest.mark.parametrize("normed", [False, True])
def test_rope_per_row_turns_each_row_at_its_own_position(normed):
    """`per_row`: row i at pos[i]; the query lands in its row, the key in its staging row i (not at a position)."""
    rng = np.random.default_rng(4)
    rows, hd = len(POSITIONS), 32
    positions = torch.tensor(POSITIONS, dtype=torch.int32, device=q_device())
    q, k = f32(rng, rows, HEADS * hd), f32(rng, rows, KV * hd)
    qw, kw = (f32(rng, hd), f32(rng, hd)) if normed else (None, None)
    weights = dict(q_norm_w=dev(qw), k_norm_w=dev(kw), eps=EPS) if normed else {}
    q_out = torch.empty(rows, HEADS * hd, device=q_device())
    k_staged = torch.zeros(rows, KV * hd, dtype=torch.float16, device=q_device())
    rope.rope_q_k(
        dev(q), dev(k), q_out, k_staged, positions, heads=HEADS, kv_heads=KV, hd=hd, base=QWEN_BASE,
        k_cache_row_pitch=KV * hd, per_row=True, **weights,
    )  # fmt: skip
    want_q, want_k = _turned(q, HEADS, hd, qw), _turned(k, KV, hd, kw)
    within(host(q_out), want_q, rope_bound(want_q, hd, max(POSITIONS) + 1, normed), "q")
    bound_k = rope_bound(want_k, hd, max(POSITIONS) + 1, normed) * (1 + U16) + U16 * np.abs(want_k)
    within(host(k_staged), want_k, bound_k, "k staged")
    alone = torch.empty(rows, KV * hd, device=q_device())
    kn = dict(norm_w=dev(kw), eps=EPS) if normed else {}
    rope.qk_norm_rope(dev(k), alone, positions, heads=KV, hd=hd, base=QWEN_BASE, per_row=True, **kn)
    within(host(alone), want_k, rope_bound(want_k, hd, max(POSITIONS) + 1, normed), "k alone")


def q_device() -> torch.device:
    return dev(np.zeros(1)).device
