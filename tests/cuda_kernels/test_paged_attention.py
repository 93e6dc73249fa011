"""The paged decode attention, the pool's row store and the rotations of a batch's rows (each at its own
position) against the cpu lane's NumPy kernels in f64.

Each row of a batch attends its own cache rows, which lie in scattered blocks of one pool found through its
table: the reference gathers them into a contiguous cache and runs the cpu lane's attention over it. Bounds are
`attention_bound`'s (derived in test_norm_rope_attention), the reference reading the unrounded rows; tiny
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

from test_norm_rope_attention import (  # noqa: E402
    EPS,
    HEADS,
    KV,
    QWEN_BASE,
    U16,
    attention_bound,
    dev,
    f32,
    host,
    rope_bound,
    weighted_norm,
    within,
)

from fuselane.graph.ops import Attention, Rope  # noqa: E402
from fuselane.lanes.cpu import kernels as ref  # noqa: E402
from fuselane.lanes.cuda.triton import quant, rope  # noqa: E402
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


def test_paged_decode_writes_int8_form():
    """With `out_q8` each row's output is also written as int8 activations: within half a code of it."""
    rng = np.random.default_rng(5)
    hd, rows = 32, len(LENS)
    k_pool, v_pool = f32(rng, POOL_BLOCKS * BLOCK, KV * hd), f32(rng, POOL_BLOCKS * BLOCK, KV * hd)
    out = torch.zeros(rows, HEADS * hd, device=q_device())
    q8 = quant.empty_q8(rows, HEADS * hd, q_device())
    lens = torch.tensor(LENS, dtype=torch.int32, device=q_device())
    paged.paged_decode(
        dev(f32(rng, rows, HEADS * hd)), dev(k_pool), dev(v_pool), _padded(_tables(rng), 5), lens, out,
        heads=HEADS, kv_heads=KV, hd=hd, scale=0.25, block_size=BLOCK, out_q8=q8,
    )  # fmt: skip
    got, back = host(out), host(quant.dequantize(q8))
    step = np.abs(got).reshape(rows, -1, 32).max(axis=2, keepdims=True) / 127
    assert np.all(np.abs(back - got).reshape(rows, -1, 32) <= step / 2 * (1 + 1e-5) + 1e-30)


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
