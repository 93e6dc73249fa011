"""The f32 GEMVs in parts with their query's and key's heads turned in the epilogue (`f32_rope`, the
activations=dequant form of `q8_rope`) against the two launches they replace: the GEMV in parts
(`fast.gemv_fast_parts` in its formats, `rows.gemv_parts` in the others), then `rope.rope_q_k`. The same sums
and the same rotation code on the same f32 values, so the raw heads and the value row equal bit for bit, and
so the turned heads where they are not normed; a normed head's sum of squares may add in another order (the
bound of `test_gemv_q8_rope.py`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, GPU_ONLY, dev, raw_weights  # noqa: E402
from test_gemv_q8_rope import BASE, EPS, HD, HEADS, KV, POS, _outputs, assert_turned_alike  # noqa: E402

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.triton import rope  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import f32_rope, fast, rows  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.parts import Part  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.turn import Turn, rope_counters  # noqa: E402

K = 256


def _layer(fmt: Format, normed: bool, rng: np.random.Generator):
    """A decode step's QKV weights in `fmt`, its f32 input, and the q/k norm weights where `normed`."""
    weights = [dev(raw_weights(fmt, n * HD, K, rng)) for n in (HEADS, KV, KV)]
    x = dev(rng.standard_normal((1, K)).astype(np.float32))
    norms = [dev(rng.uniform(0.5, 1.5, HD).astype(np.float32)) for _ in range(2)] if normed else [None, None]
    return weights, x, norms


# (format, normed): the tile-streaming GEMV's Q4_K, the GEMV by rows' Q5_K and its value-at-a-time Q3_K
CASES = [
    pytest.param(Format.Q4_K, False, id="fast-Q4_K-rope"),
    pytest.param(Format.Q5_K, True, id="rows-Q5_K-qk_norm_rope"),
    pytest.param(Format.Q3_K, False, id="rows-Q3_K-rope"),
    pytest.param(Format.Q8_0, True, id="fast-Q8_0-qk_norm_rope", marks=GPU_ONLY),
    pytest.param(Format.Q4_0, True, id="rows-Q4_0-qk_norm_rope", marks=GPU_ONLY),
]


@pytest.mark.parametrize(("fmt", "normed"), CASES)
def test_turned_in_the_epilogue_as_in_a_launch_of_its_own(fmt: Format, normed: bool) -> None:
    rng = np.random.default_rng(int(fmt) + 10 * normed)
    (wq, wk, wv), x, (qw, kw) = _layer(fmt, normed, rng)
    pos = torch.tensor([POS], dtype=torch.int32, device=DEVICE)
    pitch = KV * HD
    plain = fast.gemv_fast_parts if f32_rope.takes(fmt) == "fast" else rows.gemv_parts

    raw_q, raw_k, q_out, k_cache, v_cache = want = _outputs()
    parts = [Part(wq, HEADS * HD, raw_q), Part(wk, KV * HD, raw_k), Part(wv, KV * HD, v_cache, None, (pos, pitch))]
    plain(x, parts, fmt)
    rope.rope_q_k(raw_q, raw_k, q_out, k_cache, pos, heads=HEADS, kv_heads=KV, hd=HD, base=BASE,
                  q_norm_w=qw, k_norm_w=kw, eps=EPS, k_cache_row_pitch=pitch)  # fmt: skip

    raw_q, raw_k, q_out, k_cache, v_cache = got = _outputs()
    parts = [Part(wq, HEADS * HD, raw_q), Part(wk, KV * HD, raw_k), Part(wv, KV * HD, v_cache, None, (pos, pitch))]
    counters = rope_counters(HEADS, KV, DEVICE)
    q, k = Turn(0, q_out, HEADS, None, qw), Turn(1, k_cache, KV, pitch, kw)
    f32_rope.gemv_f32_parts_rope(x, parts, fmt, q, k, pos, counters, hd=HD, base=BASE, eps=EPS)

    assert_turned_alike(want, got, normed, counters)


def test_turned_beside_value_rows_in_another_format() -> None:
    # a Q4_K_M layer's Q6_K value rows beside its Q4_K query and key (rope_epilogue=on): the GEMV by rows takes
    # both formats in one launch and turns the heads as its launch without the turn, then the rotations, do
    rng = np.random.default_rng(21)
    fmts = (Format.Q4_K, Format.Q4_K, Format.Q6_K)
    wq, wk, wv = (dev(raw_weights(f, n * HD, K, rng)) for f, n in zip(fmts, (HEADS, KV, KV), strict=True))
    x = dev(rng.standard_normal((1, K)).astype(np.float32))
    pos = torch.tensor([POS], dtype=torch.int32, device=DEVICE)
    pitch = KV * HD

    raw_q, raw_k, q_out, k_cache, v_cache = want = _outputs()
    parts = [Part(wq, HEADS * HD, raw_q), Part(wk, KV * HD, raw_k), Part(wv, KV * HD, v_cache, None, (pos, pitch))]
    rows.gemv_parts(x, parts, fmts)
    rope.rope_q_k(raw_q, raw_k, q_out, k_cache, pos, heads=HEADS, kv_heads=KV, hd=HD, base=BASE,
                  k_cache_row_pitch=pitch)  # fmt: skip

    raw_q, raw_k, q_out, k_cache, v_cache = got = _outputs()
    parts = [Part(wq, HEADS * HD, raw_q), Part(wk, KV * HD, raw_k), Part(wv, KV * HD, v_cache, None, (pos, pitch))]
    counters = rope_counters(HEADS, KV, DEVICE)
    q, k = Turn(0, q_out, HEADS), Turn(1, k_cache, KV, pitch)
    f32_rope.gemv_f32_parts_rope(x, parts, fmts, q, k, pos, counters, hd=HD, base=BASE)

    assert_turned_alike(want, got, False, counters)


def test_the_f32_turns_take_one_row_in_a_format_they_decode() -> None:
    rng = np.random.default_rng(4)
    (wq, wk, _), x, _ = _layer(Format.Q5_K, False, rng)
    pos = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    raw_q, raw_k, q_out, k_cache, _ = _outputs()
    parts = [Part(wq, HEADS * HD, raw_q), Part(wk, KV * HD, raw_k)]
    q, k = Turn(0, q_out, HEADS), Turn(1, k_cache, KV, KV * HD)
    with pytest.raises(ValueError, match="one row"):
        f32_rope.gemv_f32_parts_rope(x.expand(2, K).contiguous(), parts, Format.Q5_K, q, k, pos,
                                     rope_counters(HEADS, KV, DEVICE), hd=HD, base=BASE)  # fmt: skip
    assert f32_rope.takes(Format.Q4_K) == "fast" and f32_rope.takes(Format.IQ4_XS) == "rows"
    assert f32_rope.takes(Format.MXFP4) == "rows"
