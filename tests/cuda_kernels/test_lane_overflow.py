"""Activations past f16's range: a checkpoint whose feed-forward activations reach about 1e6 gives finite logits
on the cpu lane and on the cuda lane (under the interpreter), in prefill and decode, within the contract, under
`prefill=int8`, `prefill=in-place` (whose kernel scales a row past f16's range first) and the default
`prefill=f16-copy` (whose rounding launch scales such a row and whose epilogue scales the product back, while an
ordinary model's logits keep the bits of the unscaled product) and `prefill=f16-scratch` (the same product, each
matrix decoded into a scratch just before it); and a value that does leave the finite range is
reported as the lane's, with the layer and op that made it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.gguf.synth import SHAPES, tensor_shapes, write_synthetic, write_weights  # noqa: E402
from fuselane.lanes.cuda.run.finite import NonFinite  # noqa: E402
from fuselane.lanes.cuda.triton import f16_scale  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

PROMPT = [5, 60, 7, 300, 8, 1, 2, 3, 4, 5, 6]  # past the GEMV's rows: the int8 GEMM runs
DECODE = [9, 10]
SHAPE = "tiny-qwen2"
# The feed-forward's norm weight and its products' spread: the gate and up products come out ~400 a value, so
# SwiGLU's output (the down product's activation) is ~1e5 a value and its largest ~1e6, and the residual
# stream ~1e5 after the first layer's feed-forward.
FFN_NORM, GATE_UP_STD, DOWN_STD, STD = 100.0, 0.5, 0.05, 0.05


def _weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for name, dims in tensor_shapes(SHAPES[SHAPE]).items():
        if len(dims) == 1:
            out[name] = (FFN_NORM if "ffn_norm" in name else 1.0) * np.ones(dims, np.float32)
            if name.endswith(".bias"):
                out[name] = np.zeros(dims, np.float32)
            continue
        std = GATE_UP_STD if ("ffn_gate" in name or "ffn_up" in name) else DOWN_STD if "ffn_down" in name else STD
        out[name] = (rng.standard_normal(dims) * std).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def loud(tmp_path_factory):
    weights = _weights(np.random.default_rng(3))
    formats = {n: Format.Q8_0 for n, w in weights.items() if w.ndim == 2}
    return write_weights(tmp_path_factory.mktemp("loud") / "loud.gguf", SHAPE, weights, formats)


def _within_contract(path, decode: list[int], knobs: list[str] = ()) -> None:
    """The cuda lane's logits (at `knobs`) of the prompt, then of each `decode` token fed, finite and within its
    contract of the cpu lane's in f64 (finite too)."""
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    gpu = load(path, lane="cuda", ctx=32, knobs=list(knobs))
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    sessions = gpu.session(), ref.session()
    steps = [[s.feed(PROMPT) for s in sessions]] + [[s.extend([t]) for s in sessions] for t in decode]
    for step, (a, b) in enumerate(steps):
        assert np.isfinite(b).all() and np.isfinite(a).all(), f"step {step}"
        err = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        assert err <= tol, f"step {step}: {err:.2e} > {tol:.2e}"


INT8 = ["prefill=int8"]


def test_activations_of_1e6_stay_finite_in_prefill(loud):
    _within_contract(loud, [], INT8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter takes over a minute a decode step")
def test_activations_of_1e6_stay_finite_in_decode(loud):
    _within_contract(loud, DECODE, INT8)


def test_the_in_kernel_f16_prefill_scales_rows_past_f16(loud):
    # the in-kernel f16 GEMM divides a row past 2^14 by a power of two before rounding it to f16
    _within_contract(loud, [], ["prefill=in-place"])


def test_the_f16_copies_scale_rows_past_f16(loud):
    # the copies: the launch that rounds the activation to f16 scales a row past 2^14 by a power of two, and
    # the product's epilogue scales it back in f32 (`triton/f16_scale.py`)
    _within_contract(loud, [], ["prefill=f16-copy"])


def test_the_f16_scratch_scales_rows_past_f16_and_keeps_no_copy(loud):
    # `prefill=f16-scratch` (what `auto`, the default, takes for a sequence's prompt): each product decodes its
    # matrix into the scratch and multiplies it as the copies do (the same rounding launch and epilogue); no
    # f16 copy of a matrix is kept
    _within_contract(loud, [], ["prefill=f16-scratch"])
    gpu = load(loud, lane="cuda", ctx=32, knobs=["prefill=f16-scratch"])
    gpu.session().feed(PROMPT)
    assert not gpu.lane._dense and gpu.lane.f16_scratch() is not None


def _unscaled(x, dense, out, *, bias=None, residual=None, out_row=None, in_place=False):
    """The f16 copies' product as it was before its rows were scaled: the activation cast to f16 as it is,
    the product up-cast, the bias and the residual added, the rows copied into place. (`in_place`, whether the
    activation may be overwritten, changes none of that: a cast of it is taken.)"""
    y = (x.to(dense.dtype) @ dense.T).float()
    if bias is not None:
        y += bias
    if residual is not None:
        y += residual
    if out_row is None:
        out.copy_(y)
    else:
        out.index_copy_(0, out_row[0].long() + torch.arange(y.shape[0], device=out.device), y.to(out.dtype))
    return out


def test_the_f16_copies_give_an_ordinary_model_the_bits_of_the_unscaled_product(tmp_path, monkeypatch):
    # every row of an ordinary model fits under 2^14: its scale is 1 and the logits are those of the product
    # before the scale, bit for bit
    path = write_synthetic(tmp_path / "m.gguf", SHAPE, "q8_0", seed=4)
    copies = ["prefill=f16-copy"]
    scaled = load(path, lane="cuda", ctx=32, knobs=copies).session().feed(PROMPT)
    calls: list[int] = []
    monkeypatch.setattr(f16_scale, "product", lambda x, *a, **k: calls.append(x.shape[0]) or _unscaled(x, *a, **k))
    unscaled = load(path, lane="cuda", ctx=32, knobs=copies).session().feed(PROMPT)
    assert calls, "no prefill product took the f16 copies"
    np.testing.assert_array_equal(scaled, unscaled)


def test_a_non_finite_value_names_the_lane_layer_and_op(tmp_path):
    # a feed-forward norm weight of 1e20: gate and up products of ~1e21, and SwiGLU's output past f32's range
    # (on the cpu lane too); the error names the cuda lane and where its numbers left the finite range
    weights = _weights(np.random.default_rng(3))
    weights["blk.0.ffn_norm.weight"] *= np.float32(1e18)
    formats = {n: Format.Q8_0 for n, w in weights.items() if w.ndim == 2}
    path = write_weights(tmp_path / "inf.gguf", SHAPE, weights, formats)
    assert not np.isfinite(load(path, lane="cpu", ctx=32).session().feed(PROMPT)).all()
    with pytest.raises(NonFinite, match=r"cuda lane computed a non-finite value at layer 0, GluActMulQuant"):
        load(path, lane="cuda", ctx=32, knobs=INT8).session().feed(PROMPT)
