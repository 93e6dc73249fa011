"""The packed latent attention (`triton/mla/packed.py`: a row's heads the rows of f16 tensor-core products, the
values the cached rows' latents) against the cpu lane in f64.

Without a GPU the kernel runs in Triton's interpreter at small widths (latents of 32 and 64 values in 2 and 4
slices, a rotated part of 16, 3-16 heads, a 100-row cache in tiles of the plan's 32 rows); the `cuda` test runs
DeepSeek-V2-Lite's heads over 4,096 rows at the plan's splits. Tolerances are
`test_attention_kernels.attention_bound`'s with f16 operands (the scaled query, the cached rows and the
weights rounded to 2^-11 each), the cache f16 as stored.
"""

from __future__ import annotations

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
from fuselane.lanes.cuda.triton import pdl  # noqa: E402
from fuselane.lanes.cuda.triton.mla import packed  # noqa: E402
from tests.cuda_kernels.test_attention_kernels import attention_bound  # noqa: E402
from tests.cuda_kernels.test_norm_rope_attention import (  # noqa: E402
    DEVICE,
    U16,
    dev,
    f32,
    host,
    within,
)

CACHE = 100  # four tiles of the plan's 32 rows, the last partial
ROT = 16


def reference(q, k, heads: int, kw: int, vd: int, p: int, scale: float, row: int = 0) -> np.ndarray:
    """Query row `row` of `q` at position p over cached rows 0..p: every head reads the one cached row, its
    values the row's first `vd` (the cpu lane's attention with the values as a slice of the keys)."""
    spec = Attention(1, heads, 1, kw, k.shape[0], scale, vd=vd)
    return ref.attention(spec, [q[row : row + 1], k, k[:, :vd]], p)


def bound(q, k, p: int, kw: int, vd: int, scale: float, row: int = 0) -> np.ndarray:
    return attention_bound(q[row : row + 1], k, k[:, :vd], 1, p + 1, kw, scale, U16, U16)


def case(rng, heads: int, vd: int, rows: int = 1, cache: int = CACHE):
    kw = vd + ROT
    q = f32(rng, rows, heads * kw)
    k = f32(rng, cache, kw)
    kc = dev(k, torch.float16)
    return q, host(kc).astype(np.float64), kc, kw


def run(q, kc, p, heads, kw, vd, scale, splits, rows=1, seq_rows=0, pos=None):
    out = torch.zeros(rows, heads * vd, device=DEVICE)
    work = packed.scratch(rows, heads, vd, splits, DEVICE) if splits > 1 else None
    pos = pos if pos is not None else torch.tensor([p], dtype=torch.int32, device=DEVICE)
    packed.latent_attention(dev(q), kc, pos, out, rows=rows, heads=heads, kw=kw, vd=vd, scale=scale, splits=splits,
                            work=work, seq_rows=seq_rows)  # fmt: skip
    return host(out), work


@pytest.mark.parametrize("heads, vd", [(3, 32), (5, 64), (16, 64)], ids=["h3-v32", "h5-v64", "h16-v64"])
@pytest.mark.parametrize("p", [0, 31, 40, CACHE - 1])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("dependent", [False, True], ids=["plain", "dependent"])
def test_packed_latent_attention_matches_cpu(heads, vd, p, splits, dependent):
    """Heads padded to the products' 16 rows, two and four value slices, a span of one tile, of a tile and a
    row, and of four tiles, in one split or merged from two or four; the counters left at zero (a replayed
    graph's next launch finds them armed for it)."""
    rng = np.random.default_rng(heads * 1000 + vd + p)
    q, k, kc, kw = case(rng, heads, vd)
    scale = kw**-0.5
    with pdl.dependent_launches(dependent):
        out, work = run(q, kc, p, heads, kw, vd, scale, splits)
    want = reference(q, k, heads, kw, vd, p, scale)
    within(out, want, bound(q, k, p, kw, vd, scale), "packed latent attention")
    if work is not None:
        assert not host(work[1]).any(), "the merge left a counter armed"


def test_a_chunks_rows_attend_up_to_their_own_positions():
    """Rows of a few-row step (not a batch): row i is at pos[0] + i, causal over the cache up to it."""
    rng = np.random.default_rng(11)
    heads, vd, rows, p = 4, 32, 3, 57
    q, k, kc, kw = case(rng, heads, vd, rows)
    scale = kw**-0.5
    out, _ = run(q, kc, p, heads, kw, vd, scale, 2, rows=rows)
    for i in range(rows):
        want = reference(q, k, heads, kw, vd, p + i, scale, row=i)
        within(out[i : i + 1], want, bound(q, k, p + i, kw, vd, scale, row=i), f"row {i}")


def test_a_batchs_rows_attend_their_own_blocks():
    """A batch (`seq_rows`): row i reads its own block of the cache at its own position."""
    rng = np.random.default_rng(12)
    heads, vd, rows, block = 4, 32, 2, 48
    q, k, kc, kw = case(rng, heads, vd, rows, cache=rows * block)
    scale = kw**-0.5
    positions = [40, 7]
    pos = torch.tensor(positions, dtype=torch.int32, device=DEVICE)
    out, _ = run(q, kc, 0, heads, kw, vd, scale, 2, rows=rows, seq_rows=block, pos=pos)
    for i, p in enumerate(positions):
        mine = k[i * block : (i + 1) * block]
        want = reference(q, mine, heads, kw, vd, p, scale, row=i)
        within(out[i : i + 1], want, bound(q, mine, p, kw, vd, scale, row=i), f"sequence {i}")


def test_what_the_kernel_takes():
    """tl.dot's sides (latent and rotated part powers of two of at least 16) and the most heads a program holds;
    the value width in slices no narrower than 16."""
    assert packed.takes(16, 576, 512) and packed.takes(4, 48, 32)
    assert not packed.takes(attn_kernels.MLA_PACKED_MOST_HEADS + 1, 576, 512)  # V3's 128 heads: the cores' kernel
    assert not packed.takes(16, 560, 512) and not packed.takes(16, 552, 488)
    assert packed.value_slices(512) == attn_kernels.MLA_PACKED_VALUE_SLICES and packed.value_slices(32) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("p", [0, 600, 4095])
def test_cuda_packed_latent_attention_at_v2_lite_heads(p):
    """V2-Lite's 16 heads of 576 -> 512 over 4,096 cached rows, at the plan's splits, against the cpu lane."""
    rng = np.random.default_rng(p)
    heads, vd, cache = 16, 512, 4096
    q = f32(rng, 1, heads * (vd + 64))
    k = f32(rng, cache, vd + 64)
    kc = dev(k, torch.float16)
    k = host(kc).astype(np.float64)
    kw, scale = vd + 64, 0.07
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = packed.splits(1, vd, cache, sms)
    assert splits > 1
    out, _ = run(q, kc, p, heads, kw, vd, scale, splits)
    want = reference(q, k, heads, kw, vd, p, scale)
    within(out, want, bound(q, k, p, kw, vd, scale), "packed latent attention")
