"""The int8 GEMV in parts with its query's and key's heads turned in the epilogue (`gemv_q8_rope`) against the
two launches it replaces: `gemv_q8.gemv_q8_parts`, then `rope.rope_q_k`. The same sums and the same rotation
code on the same f32 values: the raw heads and the value row equal bit for bit, and so the turned heads where
they are not normed. A normed head's sum of squares is one `tl.sum` whose order of additions follows the
tile's layout (a head alone in the epilogue, a few rows of every head in the launch), so compiled for a GPU
the two may differ by that order: at most HD - 1 roundings of the sum (HD u of it, relative), half that in its
rsqrt, on values the rotation then mixes in pairs; an f16 cache row may round either side of one f16 step.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, GPU_ONLY, dev, raw_weights  # noqa: E402

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.graph.ops import Yarn  # noqa: E402
from fuselane.lanes.cuda.triton import quant, rope  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.q8 import gemv_q8_parts  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.q8_rope import Turn, gemv_q8_parts_rope, rope_counters  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.rows import Part  # noqa: E402

HEADS, KV, HD, K, CTX, POS = 4, 2, 64, 256, 8, 5
U, U16 = 2.0**-24, 2.0**-11  # f32's and f16's unit roundoff
BASE, EPS = 1e6, 1e-6
TILE = {"block_n": 4, "warps": 1, "per_thread": 1}  # 16 programs a head: the count decides who turns it
YARN = Yarn(factor=4.0, original=4096, beta_fast=32.0, beta_slow=1.0)  # the ramp falls inside a head of 64


def _layer(fmt: Format, normed: bool, rng: np.random.Generator, v_fmt: Format | None = None):
    """A decode step's QKV weights in `fmt` (the value's in `v_fmt` where given), its quantized input, and the
    q/k norm weights where `normed`."""
    fmts = (fmt, fmt, v_fmt or fmt)
    weights = [dev(raw_weights(f, n * HD, K, rng)) for f, n in zip(fmts, (HEADS, KV, KV), strict=True)]
    x = rng.standard_normal((1, K)).astype(np.float32)
    acts = quant.quantize(dev(x), quant.empty_q8(1, K, DEVICE))
    norms = [dev(rng.uniform(0.5, 1.5, HD).astype(np.float32)) for _ in range(2)] if normed else [None, None]
    return weights, acts, norms


def _outputs():
    """Fresh raw q and k rows, the turned query, and the caches (filled with NaN: only row POS is written)."""
    raw_q, raw_k = torch.zeros(1, HEADS * HD, device=DEVICE), torch.zeros(1, KV * HD, device=DEVICE)
    q_out = torch.full((1, HEADS * HD), float("nan"), device=DEVICE)
    k_cache, v_cache = (torch.full((CTX, KV * HD), float("nan"), device=DEVICE).half() for _ in range(2))
    return raw_q, raw_k, q_out, k_cache, v_cache


def _cases() -> list:
    """Every format x (norm or not) x tile. Interpreted, a case takes 35-70 s, so CI runs the four of an
    orthogonal array (each pair of the three choices' values met once) and the GPU run the other four."""
    cases = []
    for fmt in (Format.Q4_K, Format.Q8_0):
        for normed in (False, True):
            for tile, tile_id in ((TILE, "small_tile"), ({}, "landed_tile")):
                # the half of even parity: every pair of two choices' values appears once in it
                in_ci = ((fmt is Format.Q8_0) + normed + (tile_id == "small_tile")) % 2 == 0
                marks = () if in_ci else GPU_ONLY
                name = f"{fmt.name}-{'qk_norm_rope' if normed else 'rope'}-{tile_id}"
                cases.append(pytest.param(fmt, normed, tile, None, None, marks=marks, id=name))
    # YaRN's stretched frequencies, turned in the epilogue as in the rotations' own launch
    cases.append(pytest.param(Format.Q4_K, True, TILE, YARN, None, id="Q4_K-qk_norm_rope-small_tile-yarn"))
    # a Q4_K_M layer's Q6_K value rows in the same launch (two formats in parts)
    cases.append(pytest.param(Format.Q4_K, False, {}, None, Format.Q6_K, marks=GPU_ONLY, id="Q4_K-rope-q6_k_v"))
    return cases


@pytest.mark.parametrize(("fmt", "normed", "tile", "yarn", "v_fmt"), _cases())
def test_turned_in_the_epilogue_as_in_a_launch_of_its_own(
    fmt: Format, normed: bool, tile: dict, yarn, v_fmt: Format | None
) -> None:
    rng = np.random.default_rng(int(fmt) + 10 * normed)
    (wq, wk, wv), acts, (qw, kw) = _layer(fmt, normed, rng, v_fmt)
    fmt = (fmt, fmt, v_fmt) if v_fmt is not None else fmt
    pos = torch.tensor([POS], dtype=torch.int32, device=DEVICE)
    pitch = KV * HD

    raw_q, raw_k, q_out, k_cache, v_cache = want = _outputs()
    parts = [Part(wq, HEADS * HD, raw_q), Part(wk, KV * HD, raw_k), Part(wv, KV * HD, v_cache, None, (pos, pitch))]
    gemv_q8_parts(acts, parts, fmt, **tile)
    rope.rope_q_k(raw_q, raw_k, q_out, k_cache, pos, heads=HEADS, kv_heads=KV, hd=HD, base=BASE,
                  q_norm_w=qw, k_norm_w=kw, eps=EPS, k_cache_row_pitch=pitch, yarn=yarn)  # fmt: skip

    raw_q, raw_k, q_out, k_cache, v_cache = got = _outputs()
    parts = [Part(wq, HEADS * HD, raw_q), Part(wk, KV * HD, raw_k), Part(wv, KV * HD, v_cache, None, (pos, pitch))]
    counters = rope_counters(HEADS, KV, DEVICE)
    q, k = Turn(0, q_out, HEADS, None, qw), Turn(1, k_cache, KV, pitch, kw)
    gemv_q8_parts_rope(acts, parts, fmt, q, k, pos, counters, hd=HD, base=BASE, eps=EPS, yarn=yarn, **tile)

    assert_turned_alike(want, got, normed, counters)


def assert_turned_alike(want, got, normed: bool, counters) -> None:
    """`_outputs()` of the two launches against those of the one: the raw heads and the value row bit for bit, the
    turned heads too where not normed (else within the sums' order), every turned value written, the counters
    re-armed for the next launch."""
    for a, b, turned in zip(want, got, (False, False, True, True, False), strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        if turned and normed:
            _within_the_sums_order(a.nan_to_num(), b.nan_to_num())
        else:
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    _, _, q_out, k_cache, _ = got
    assert not k_cache[POS].isnan().any() and not q_out.isnan().any()
    assert not counters.any()


def _within_the_sums_order(a, b) -> None:
    """Turned heads from the same values, their norms' sums added in two orders: each value within HD u of its
    head's largest pair (the norm's factor HD u / 2, the pair's two products doubling it), plus an f16 step
    where the values are the cache's."""
    heads = a.double().view(a.shape[0], -1, HD)
    most = heads.abs().amax(dim=2, keepdim=True)
    step = 2 * U16 * heads.abs() if a.dtype == torch.float16 else 0.0  # one f16 step: at most 2 u16, relative
    bound = HD * U * most + step
    assert bool(((heads - b.double().view_as(heads)).abs() <= bound).all())


def test_turns_are_checked() -> None:
    rng = np.random.default_rng(3)
    (wq, wk, wv), acts, _ = _layer(Format.Q4_K, False, rng)
    pos = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    raw_q, raw_k, q_out, k_cache, _ = _outputs()
    parts = [Part(wq, HEADS * HD, raw_q), Part(wk, KV * HD, raw_k)]
    counters = rope_counters(HEADS, KV, DEVICE)
    q, k = Turn(0, q_out, HEADS), Turn(1, k_cache, KV, KV * HD)
    with pytest.raises(ValueError, match="two of the 2 parts"):
        gemv_q8_parts_rope(acts, parts, Format.Q4_K, q, q, pos, counters, hd=HD, base=BASE, **TILE)
    with pytest.raises(ValueError, match="heads of"):
        gemv_q8_parts_rope(acts, parts, Format.Q4_K, q, Turn(1, k_cache, HEADS), pos, counters, hd=HD, base=BASE)
    with pytest.raises(ValueError, match="rope_counters"):
        gemv_q8_parts_rope(acts, parts, Format.Q4_K, q, k, pos, counters[:1], hd=HD, base=BASE, **TILE)
    with pytest.raises(ValueError, match="does not divide a head"):
        gemv_q8_parts_rope(acts, parts, Format.Q4_K, q, k, pos, counters, hd=HD, base=BASE, block_n=128, warps=4,
                           per_thread=1)  # fmt: skip
