"""`prefill=f16-copy`'s product (`triton/f16_scale.py`) against NumPy and against the product it replaced, and
`prefill=f16-scratch`'s (the matrix decoded from its checkpoint rows into a scratch, in slabs where it does not
fit) against the copy's.

- The rounding launch: a row whose |values| are at most 2^14 is rounded to f16 as it is, under a scale of
  exactly 1; a row past it is multiplied by the least power of two 2^-e that brings it under (exact in f32),
  then rounded, and 2^e written as its scale.
- The epilogue: each row of the f16 product times its scale, plus the bias, plus the residual, in f32 in that
  order: the same numbers, bit for bit, as the f32 arithmetic NumPy does.
- The whole product: a chunk of ordinary rows gives the same bits as the product it replaced (the activation cast
  to f16, the same matrix product, up-cast, bias and residual added, copied into place); rows of ~1e6 next to
  them stay finite, within the bound of `test_gemm`'s scaled rows (f32 sums within gamma_k * sum |w x|; the
  activation's and the product's f16 roundings 2^-11 each, relative; a value the scale leaves below f16's
  normals within 2^-25 of its row's scale), of the f64 product.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, U16, U32, check, dev, file_blocks, gamma  # noqa: E402

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.triton import f16_scale as S  # noqa: E402

SAFE = 2.0**14  # gemm.F16_SAFE: the largest |value| a row keeps a scale of 1 at
SUBNORMAL_STEP = 2.0**-25  # half the spacing of f16's subnormals: a scaled value below 2^-14 rounds within it
M, N, K = 20, 24, 160
BLOCK = 128  # the rounding launch's block: a row of K takes a whole one and a partial one


def _activations(rng: np.random.Generator) -> np.ndarray:
    """Rows of ~1, rows at and just past 2^14, rows of ~1e6 and one of ~1e30 (f16 holds 65504)."""
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[1, 5] = SAFE  # exactly 2^14: fits
    x[2, 7] = -np.nextafter(np.float32(SAFE), np.float32(np.inf))  # just past: a scale of 2
    x[3::4] *= np.float32(1e6)
    x[5, 3] = np.float32(1e30)
    return x


def _scales(x: np.ndarray) -> np.ndarray:
    """Each row's scale: 1 where its largest |value| is at most 2^14, else the least power of two past
    largest / 2^14."""
    amax = np.abs(x.astype(np.float64)).max(axis=1)
    return np.where(amax <= SAFE, 1.0, 2.0 ** np.ceil(np.log2(amax / SAFE)))


def test_rounding_scales_only_rows_past_2_14_by_a_power_of_two():
    x = _activations(np.random.default_rng(1))
    x16, scales = torch.empty((M, K), dtype=torch.float16, device=DEVICE), torch.empty(M, device=DEVICE)
    S.to_f16(dev(x), x16, scales, block=BLOCK)
    want_s = _scales(x)
    assert want_s[0] == 1.0 and want_s[1] == 1.0 and want_s[2] == 2.0 and want_s[5] == 2.0**86  # 1e30 / 2^14 is 2^85.7
    np.testing.assert_array_equal(scales.cpu().numpy(), want_s)
    want = (x / want_s[:, None].astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(x16.cpu().numpy().view(np.uint16), want.view(np.uint16))
    assert np.isfinite(x16.cpu().numpy()).all()


def test_rounding_leaves_rows_that_fit_as_a_cast_does():
    x = np.random.default_rng(2).standard_normal((M, K)).astype(np.float32) * np.float32(4000)
    x16, scales = torch.empty((M, K), dtype=torch.float16, device=DEVICE), torch.empty(M, device=DEVICE)
    S.to_f16(dev(x), x16, scales, block=BLOCK)
    assert torch.equal(scales, torch.ones(M, device=DEVICE))
    assert torch.equal(x16.view(torch.int16), dev(x).to(torch.float16).view(torch.int16))


def test_epilogue_scales_before_the_bias_and_residual():
    rng = np.random.default_rng(3)
    y = (rng.standard_normal((M, N)) * 100).astype(np.float16)
    s = (2.0 ** rng.integers(0, 40, M)).astype(np.float32)
    bias, res = rng.standard_normal(N).astype(np.float32), rng.standard_normal((M, N)).astype(np.float32)
    out = dev(res.copy())
    S.scaled_store(dev(y), dev(s), out, bias=dev(bias), residual=out)
    want = y.astype(np.float32) * s[:, None] + bias + res
    np.testing.assert_array_equal(out.cpu().numpy(), want)


def _replaced(x, dense, bias, res):
    """The product `prefill=f16-copy` ran before its rows were scaled: cast, multiply, up-cast, add."""
    y = (x.to(dense.dtype) @ dense.T).float()
    y += bias
    y += res
    return y


def _problem(seed: int):
    rng = np.random.default_rng(seed)
    w16 = (rng.standard_normal((N, K)) * 0.05).astype(np.float16)
    bias, res = rng.standard_normal(N).astype(np.float32), rng.standard_normal((M, N)).astype(np.float32)
    return w16, bias, res


def test_rows_that_fit_give_the_bits_they_gave_before():
    w16, bias, res = _problem(4)
    x = dev(np.random.default_rng(5).standard_normal((M, K)).astype(np.float32) * np.float32(100))
    before = _replaced(x, dev(w16), dev(bias), dev(res))
    out = dev(res.copy())
    S.product(x, dev(w16), out, bias=dev(bias), residual=out)
    assert torch.equal(out, before)


def test_rows_past_f16_stay_finite_within_f16_roundoff_of_f64():
    w16, bias, res = _problem(6)
    x = _activations(np.random.default_rng(7))
    x[5, 3] = np.float32(3e9)  # a product row of ~1e8: f16's rounding of it still within the bound's terms
    xd, w = x.astype(np.float64), w16.astype(np.float64)
    assert np.isinf(x.astype(np.float16)).any()  # as it is, the activation does not fit f16
    out = dev(res.copy())
    S.product(dev(x), dev(w16), out, bias=dev(bias), residual=out)
    want = xd @ w.T + bias + res
    mag = np.abs(xd) @ np.abs(w).T
    tiny = _scales(x)[:, None] * SUBNORMAL_STEP * np.abs(w).sum(axis=1)[None, :]
    bound = (gamma(K) + 2 * U16) * (1 + 2 * U16) * mag + tiny + 2 * U32 * (np.abs(want) + np.abs(bias) + np.abs(res))
    assert np.isfinite(out.cpu().numpy()).all()
    check(out, want, bound)


def test_rows_land_at_a_table_row_in_f16():
    # a cache row's write: the rows land from row pos[0] of an f16 table, as before
    w16, bias, _ = _problem(8)
    x = dev(np.random.default_rng(9).standard_normal((M, K)).astype(np.float32))
    table = torch.zeros((M + 6, N), dtype=torch.float16, device=DEVICE)
    pos = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    S.product(x, dev(w16), table, bias=dev(bias), out_row=(pos, table.stride(0)))
    before = (x.to(torch.float16) @ dev(w16).T).float() + dev(bias)
    assert torch.equal(table[4 : 4 + M], before.to(torch.float16))
    assert not table[:4].any() and not table[4 + M :].any()


def _checkpoint_rows(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An N x K matrix as Q8_0 checkpoint rows (the GGUF's bytes) and its values in f16, as an f16 copy holds
    them."""
    from gguf import GGMLQuantizationType, quants

    w = (np.random.default_rng(seed).standard_normal((N, K)) * 0.05).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)
    values = quants.dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float16)
    return file_blocks(Format.Q8_0, raw.reshape(-1), K), values


@pytest.mark.parametrize("in_place", [False, True])  # the activation rounded into a copy, or into its own bytes
@pytest.mark.parametrize("scratch_rows", [N, 7])  # the whole matrix at once; slabs of 7 rows (7, 7, 7, 3)
def test_the_scratch_product_gives_the_bits_of_the_copys(scratch_rows, in_place):
    # `prefill=f16-scratch`: the matrix decoded into the scratch (a slab at a time where it does not fit) and
    # multiplied as its f16 copy would be, the bias and residual taken column slab by column slab
    from fuselane.gguf.formats import Format

    raw, w16 = _checkpoint_rows(10)
    _, bias, res = _problem(11)
    x = _activations(np.random.default_rng(12))
    want = dev(res.copy())
    S.product(dev(x), dev(w16), want, bias=dev(bias), residual=want)
    out = dev(res.copy())
    scratch = torch.empty(scratch_rows * K, dtype=torch.float16, device=DEVICE)
    xt = dev(x.copy())  # on the CPU `dev` shares the array's memory, which rounding in place overwrites
    S.product_from_bytes(xt, dev(raw), Format.Q8_0, N, K, scratch, out, bias=dev(bias), residual=out, in_place=in_place)
    assert torch.equal(out, want)
    assert torch.equal(xt, dev(x)) != in_place  # rounded in place, its bytes hold the f16 rows


def test_the_scratch_products_rows_land_at_a_table_row():
    from fuselane.gguf.formats import Format

    raw, w16 = _checkpoint_rows(13)
    x = dev(np.random.default_rng(14).standard_normal((M, K)).astype(np.float32))
    pos = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    tables = [torch.zeros((M + 6, N), dtype=torch.float16, device=DEVICE) for _ in range(2)]
    S.product(x, dev(w16), tables[0], out_row=(pos, tables[0].stride(0)))
    scratch = torch.empty(5 * K, dtype=torch.float16, device=DEVICE)  # slabs of 5 rows
    S.product_from_bytes(x, dev(raw), Format.Q8_0, N, K, scratch, tables[1], out_row=(pos, tables[1].stride(0)))
    assert torch.equal(tables[1], tables[0])


def _pair(seed: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """A gated pair as checkpoint rows in two formats (the gate Q8_0, the up Q4_0), each (bytes, f16 values)."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    found = []
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
        w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        raw = quants.quantize(w, kind)
        fmt = Format.Q8_0 if kind == GGMLQuantizationType.Q8_0 else Format.Q4_0
        found.append((file_blocks(fmt, raw.reshape(-1), K), quants.dequantize(raw, kind).astype(np.float16)))
    return found[0], found[1]


def _pair_activations(seed: int) -> np.ndarray:
    """`_activations` with its 1e30 value at 3e6: the GLU of a 1e30 row (its square) is past f32's range."""
    x = _activations(np.random.default_rng(seed))
    x[5, 3] = np.float32(3e6)
    return x


def _apart(x, g16, u16):
    """What the pair ran as before: each product on its own (`product`, f32 stores), then `glu_act_mul`."""
    from fuselane.lanes.cuda.triton import misc

    gate, up, out = (torch.empty((M, N), device=DEVICE) for _ in range(3))
    S.product(x, g16, gate)
    S.product(x, u16, up)
    misc.glu_act_mul(gate, up, out)
    return out


def test_the_pair_gives_the_bits_of_its_products_then_its_glu():
    # the gated pair in one rounding and one epilogue: the bits its two products and the GLU launch gave,
    # rows past 2^14 included (their scale multiplies each product back before the GLU)
    (_, g16), (_, u16) = _pair(15)
    x = dev(_pair_activations(16))
    out = torch.empty((M, N), device=DEVICE)
    S.gate_up_glu(x, dev(g16), dev(u16), out)
    want = _apart(x, dev(g16), dev(u16))
    assert torch.isfinite(out).all()
    assert torch.equal(out, want)


@pytest.mark.parametrize("scratch_rows", [N, 7])  # the whole pair at once; slabs of 7 rows of each (7, 7, 7, 3)
def test_the_scratch_pair_gives_the_bits_of_the_copies(scratch_rows):
    from fuselane.gguf.formats import Format

    (graw, g16), (uraw, u16) = _pair(17)
    x = dev(_pair_activations(18))
    want = torch.empty((M, N), device=DEVICE)
    S.gate_up_glu(x, dev(g16), dev(u16), want)
    scratch = torch.empty(2 * scratch_rows * K, dtype=torch.float16, device=DEVICE)
    out = torch.empty((M, N), device=DEVICE)
    gate, up = (dev(graw), Format.Q8_0), (dev(uraw), Format.Q4_0)
    S.gate_up_glu_from_bytes(x, gate, up, N, K, scratch, out)
    assert torch.equal(out, want)


def test_a_scratch_without_a_pair_of_rows_is_refused():
    from fuselane.gguf.formats import Format

    (graw, _), (uraw, _) = _pair(19)
    scratch = torch.empty(2 * K - 1, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="no pair of rows"):
        S.gate_up_glu_from_bytes(
            dev(np.zeros((M, K), np.float32)), (dev(graw), Format.Q8_0), (dev(uraw), Format.Q4_0), N, K, scratch,
            torch.empty((M, N), device=DEVICE),
        )  # fmt: skip


def test_a_slab_takes_whole_steps_of_rows_where_the_matrix_does_not_fit():
    # cuBLAS's fast f16 kernels want an output pitch of whole 8-value steps: a slab of 885 rows of a 7B's down
    # product took twice as long as one of 768
    from fuselane.lanes.cuda.plan.kernels import F16_SLAB_STEP

    assert S._slab_rows(18944, 2340) % F16_SLAB_STEP == 0
    assert S._slab_rows(3584, 885) % 8 == 0
    # as few slabs as the scratch allows, as even as whole steps make them: no narrow last slab
    for n, fits in ((3584, 1771), (18944, 4681), (152064, 9362), (18944, 2340), (3584, 885), (1000, 130)):
        rows, most = S._slab_rows(n, fits), fits // F16_SLAB_STEP * F16_SLAB_STEP
        assert rows % F16_SLAB_STEP == 0 and rows <= most
        slabs = -(-n // rows)
        assert slabs == -(-n // most)
        assert n - (slabs - 1) * rows > rows - F16_SLAB_STEP * slabs
    assert S._slab_rows(3584, 1771) == 1280  # a 7B's down in 32 Mi values: 1,280, 1,280, 1,024 (not ..., 256)
    assert S._slab_rows(24, 30) == 24  # the whole matrix fits
    assert S._slab_rows(24, 7) == 7  # a scratch of fewer rows than a step: all it holds (the tests' slabs)


def test_rounding_in_place_gives_the_copys_bits_and_scales():
    # a dying activation rounded into its own bytes: each row's f16 values in the first half of its span, at a
    # pitch past its width, rows that fit and rows past 2^14 alike, a block and a partial one a row
    x = _activations(np.random.default_rng(21))
    x16, scales = torch.empty((M, K), dtype=torch.float16, device=DEVICE), torch.empty(M, device=DEVICE)
    S.to_f16(dev(x), x16, scales, block=BLOCK)
    wide = torch.full((M, K + 32), float("nan"), device=DEVICE)  # a pitch of K + 32 values
    wide[:, :K] = dev(x)
    in_place_scales = torch.empty(M, device=DEVICE)
    got = S.to_f16_in_place(wide[:, :K], in_place_scales, block=BLOCK)
    assert got.data_ptr() == wide.data_ptr() and got.stride() == (2 * (K + 32), 1)
    assert torch.equal(got.view(torch.int16), x16.view(torch.int16))
    assert torch.equal(in_place_scales, scales)


@pytest.mark.parametrize("scratch_rows", [N, 7])
def test_products_rounding_in_place_give_the_bits_of_the_copies(scratch_rows):
    # the copy's product and the gated pair over an activation they may overwrite (each a copy of its own: on the
    # CPU `dev` shares the array's memory): the bits they give over a rounded copy
    from fuselane.gguf.formats import Format

    _, w16 = _checkpoint_rows(22)
    x = _activations(np.random.default_rng(24))
    copy_out, dense_out = (torch.empty((M, N), device=DEVICE) for _ in range(2))
    S.product(dev(x), dev(w16), copy_out)
    S.product(dev(x.copy()), dev(w16), dense_out, in_place=True)
    assert torch.equal(dense_out, copy_out)
    scratch = torch.empty(2 * scratch_rows * K, dtype=torch.float16, device=DEVICE)
    (graw, g16), (uraw, u16) = _pair(25)
    xp = _pair_activations(26)
    pair_want = torch.empty((M, N), device=DEVICE)
    S.gate_up_glu(dev(xp), dev(g16), dev(u16), pair_want)
    pair_out = torch.empty((M, N), device=DEVICE)
    gate, up = (dev(graw), Format.Q8_0), (dev(uraw), Format.Q4_0)
    xt = dev(xp.copy())
    S.gate_up_glu_from_bytes(xt, gate, up, N, K, scratch, pair_out, in_place=True)
    assert torch.equal(pair_out, pair_want)
    assert not torch.equal(xt, dev(xp))
    S.gate_up_glu(dev(xp.copy()), dev(g16), dev(u16), pair_out, in_place=True)
    assert torch.equal(pair_out, pair_want)
