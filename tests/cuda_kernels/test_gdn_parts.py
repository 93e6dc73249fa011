"""The gated delta rule's three launches that take what ran apart (`triton.gdn`): several convolutions in one
launch (ConvParts), the gates with the `ssm_ba` product that feeds them (GdnGateProjections), and the gated
norm writing its int8 form in its store (GdnOutputQuant), against the cpu lane's kernels in f64 at tiny shapes
under the interpreter on a CPU.

Bounds (Higham 3.1, gamma_k as kernel_checks): each convolution part is the convolution's own launch, so its
bound is that of `test_gdn_kernels` (a sum of `taps` f32 products and the SiLU's roundings, a head's L2 norm
within norm_rel of its length); the states move, not computed. A gate's product is an f32 sum of k products,
within gamma(k) of the sum of |w x|, which the sigmoid (derivative at most 1/4) and the softplus (at most 1,
then times |A|) carry on, plus the gates' own roundings. The int8 form is the `Quantize` launch's arithmetic on
the values the launch stores: its codes, scales and sums bit for bit those of `quant.quantize_reference`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, dev, gamma, norm_rel  # noqa: E402

from fuselane.graph.ops import CausalConv, ConvShift, L2Norm, RmsNorm  # noqa: E402
from fuselane.lanes.cpu import gdn_kernels as ref  # noqa: E402
from fuselane.lanes.cpu.kernels import rms_norm  # noqa: E402
from fuselane.lanes.cuda.triton import quant  # noqa: E402
from fuselane.lanes.cuda.triton.gdn import conv, conv_parts, gates, norm  # noqa: E402

SILU_ROUNDINGS = 8  # the sigmoid's exponential (approximate on a GPU: 4u), its add and division, the product
TAPS, DK, EPS = 4, 32, 1e-6


def rel(a, b) -> float:
    a = a.detach().cpu().double().numpy() if isinstance(a, torch.Tensor) else a
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def silu(x):
    return x / (1 + np.exp(-x))


def f32(a: np.ndarray):
    return dev(a.astype(np.float32))


def _conv_want(x, state, w, rows):
    chan = x.shape[1]
    out = silu(ref.causal_conv(CausalConv(rows, chan, TAPS), [x, state, w], 0))
    return out, ref.conv_shift(ConvShift(rows, chan, TAPS - 1), [x, state], 0)


@pytest.mark.parametrize("rows", [1, 3, conv.ROW_TILE + 3])  # past a row block: several programs
def test_a_launch_of_convolutions_convolves_each_part_as_alone(rows):
    rng = np.random.default_rng(30 + rows)
    # a q-and-k part normed in its epilogue (heads of DK), a wider plain part, a narrow part past no whole block
    chans, normed = [2 * 2 * DK, 5 * DK + 8, 40], [True, False, False]
    parts, wants = [], []
    for chan, n in zip(chans, normed, strict=True):
        x = rng.standard_normal((rows, chan))
        state, w = rng.standard_normal((TAPS - 1, chan)), rng.standard_normal((chan, TAPS))
        out, st = torch.zeros((rows, chan), device=DEVICE), f32(state)
        kw = chan // 2
        qk = conv.Normed(torch.zeros((rows, kw), device=DEVICE), torch.zeros((rows, kw), device=DEVICE), kw, DK, EPS)
        parts.append(conv_parts.Part(f32(x), st, f32(w), out, chan, shift=True, normed=qk if n else None))
        wants.append(_conv_want(x, state, w, rows))
    conv_parts.conv_parts(parts, rows=rows, taps=TAPS)
    bound = TAPS * gamma(TAPS + SILU_ROUNDINGS)
    for part, (want, want_state) in zip(parts, wants, strict=True):
        assert rel(part.out, want) <= bound
        assert rel(part.state, want_state) <= gamma(1)  # moved, not computed
        if part.normed is not None:
            kw, l2 = part.normed.key_width, L2Norm(rows * part.normed.key_width // DK, DK, EPS)
            for got, cols in ((part.normed.q, want[:, :kw]), (part.normed.k, want[:, kw : 2 * kw])):
                exact = ref.l2_norm(l2, [cols], 0).reshape(rows, kw)
                assert rel(got, exact) <= norm_rel(DK) + bound


def test_a_launch_of_convolutions_refuses_what_it_cannot_take():
    x = torch.zeros((1, 64), device=DEVICE)
    part = conv_parts.Part(x, torch.zeros((TAPS - 1, 64), device=DEVICE), x, x, 64, shift=False)
    with pytest.raises(ValueError, match="1 to 4 parts"):
        conv_parts.conv_parts([part] * 5, rows=1, taps=TAPS)
    heads = [conv.Normed(x, x, 32, w, EPS) for w in (16, 32)]
    with pytest.raises(ValueError, match="heads of one width"):
        conv_parts.conv_parts([conv_parts.Part(x, x, x, x, 64, False, h) for h in heads], rows=1, taps=TAPS)


@pytest.mark.parametrize(("rows", "k"), [(1, 96), (3, 40)])
def test_the_gates_take_their_projection_in_the_same_launch(rows, k):
    rng = np.random.default_rng(40 + rows)
    key_heads, heads = 2, 6
    per = heads // key_heads
    x, w = rng.standard_normal((rows, k)), rng.standard_normal((2 * heads, k)) / np.sqrt(k)
    dt, coef = rng.standard_normal(heads), -np.exp(rng.standard_normal(heads))
    beta, g = torch.zeros((rows, heads), device=DEVICE), torch.zeros((rows, heads), device=DEVICE)
    gates.projected(f32(x), f32(w), f32(dt), f32(coef), beta, g, rows=rows, heads=heads, key_heads=key_heads, k=k)
    ba = (x @ w.T).reshape(rows * key_heads, 2 * per)  # the product as the file's groups hold it
    b, a = ba[:, :per].reshape(rows, heads), ba[:, per:].reshape(rows, heads)
    product = gamma(k) * (np.abs(x) @ np.abs(w.T)).reshape(rows * key_heads, 2 * per)  # sum |w x| bound
    pb, pa = product[:, :per].reshape(rows, heads), product[:, per:].reshape(rows, heads)
    want_beta, want_g = 1 / (1 + np.exp(-b)), coef * np.logaddexp(0, a + dt)
    got_beta, got_g = beta.double().cpu().numpy(), g.double().cpu().numpy()
    assert np.all(np.abs(got_beta - want_beta) <= pb / 4 + gamma(SILU_ROUNDINGS) * want_beta)
    assert np.all(np.abs(got_g - want_g) <= np.abs(coef) * pa + gamma(SILU_ROUNDINGS) * np.abs(want_g))


def test_the_gates_projection_takes_only_its_matrix_as_f32():
    x = torch.zeros((1, 8), device=DEVICE)
    with pytest.raises(ValueError, match="contiguous f32"):
        gates.projected(x, torch.zeros((4, 8), device=DEVICE), x, x, x, x, rows=1, heads=4, key_heads=2, k=8)


@pytest.mark.parametrize("d", [32, 96])  # a head one block, and three (not a power of two: a masked tail)
def test_the_gated_norm_writes_its_int8_form_in_its_store(d):
    rng = np.random.default_rng(50 + d)
    rows, heads = 2, 3
    units = rows * heads
    x, z, w = rng.standard_normal((units, d)), rng.standard_normal((units, d)) * 2, rng.standard_normal(d)
    out = torch.zeros((units, d), device=DEVICE)
    q8 = quant.empty_q8(rows, heads * d, DEVICE)
    norm.gated_norm(f32(x), f32(w), f32(z), out, units=units, d=d, eps=EPS, out_q8=q8)
    want = rms_norm(RmsNorm(units, d, EPS), [x], 0) * w * silu(z)
    assert rel(out, want) <= norm_rel(d) + gamma(SILU_ROUNDINGS)
    codes, scales, sums = quant.quantize_reference(out.cpu().numpy().reshape(rows, heads * d))
    assert np.array_equal(q8.q.cpu().numpy(), codes)
    assert np.array_equal(q8.d.cpu().numpy(), scales) and np.array_equal(q8.s.cpu().numpy(), sums)


def test_the_gated_norm_quantizes_only_whole_blocks():
    x = torch.zeros((2, 16), device=DEVICE)
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        norm.gated_norm(x, x[0], x, x, units=2, d=16, eps=EPS, out_q8=quant.empty_q8(1, 32, DEVICE))


# --- compiled, at Qwen3-Next-80B-A3B's widths (`pytest -m cuda`) ------------------------------------------------

REAL_K_HEADS, REAL_V_HEADS, REAL_DIM, REAL_EMBD = 16, 32, 128, 2048


@pytest.mark.parametrize("rows", [1, 70])
@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs an NVIDIA GPU")
def test_the_real_widths_gates_with_their_projection(rows):
    rng = np.random.default_rng(60 + rows)
    heads, k = REAL_V_HEADS, REAL_EMBD
    x, w = rng.standard_normal((rows, k)), rng.standard_normal((2 * heads, k)) / np.sqrt(k)
    dt, coef = rng.standard_normal(heads), -np.exp(rng.standard_normal(heads))
    beta, g = torch.zeros((rows, heads), device=DEVICE), torch.zeros((rows, heads), device=DEVICE)
    gates.projected(f32(x), f32(w), f32(dt), f32(coef), beta, g, rows=rows, heads=heads, key_heads=REAL_K_HEADS,
                    k=k)  # fmt: skip
    torch.cuda.synchronize()
    per = heads // REAL_K_HEADS
    ba = (x @ w.T).reshape(rows * REAL_K_HEADS, 2 * per)
    bound = (gamma(k) * (np.abs(x) @ np.abs(w.T))).reshape(rows * REAL_K_HEADS, 2 * per)
    b, a = ba[:, :per].reshape(rows, heads), ba[:, per:].reshape(rows, heads)
    pb, pa = bound[:, :per].reshape(rows, heads), bound[:, per:].reshape(rows, heads)
    want_beta, want_g = 1 / (1 + np.exp(-b)), coef * np.logaddexp(0, a + dt)
    assert np.all(np.abs(beta.double().cpu().numpy() - want_beta) <= pb / 4 + gamma(SILU_ROUNDINGS) * want_beta)
    err_g = np.abs(g.double().cpu().numpy() - want_g)
    assert np.all(err_g <= np.abs(coef) * pa + gamma(SILU_ROUNDINGS) * np.abs(want_g))


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs an NVIDIA GPU")
def test_the_real_widths_gated_norm_and_its_int8_form():
    rng = np.random.default_rng(61)
    units, d = REAL_V_HEADS, REAL_DIM
    x, z, w = rng.standard_normal((units, d)), rng.standard_normal((units, d)), rng.standard_normal(d)
    out, q8 = torch.zeros((units, d), device=DEVICE), quant.empty_q8(1, units * d, DEVICE)
    norm.gated_norm(f32(x), f32(w), f32(z), out, units=units, d=d, eps=EPS, out_q8=q8)
    torch.cuda.synchronize()
    want = rms_norm(RmsNorm(units, d, EPS), [x], 0) * w * silu(z)
    assert rel(out, want) <= norm_rel(d) + gamma(SILU_ROUNDINGS)
    codes, scales, sums = quant.quantize_reference(out.cpu().numpy().reshape(1, -1))
    assert np.array_equal(q8.q.cpu().numpy(), codes) and np.array_equal(q8.d.cpu().numpy(), scales)
    assert np.array_equal(q8.s.cpu().numpy(), sums)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs an NVIDIA GPU")
def test_the_real_widths_convolutions_in_one_launch():
    rng = np.random.default_rng(62)
    kw, vw = REAL_K_HEADS * REAL_DIM, REAL_V_HEADS * REAL_DIM
    parts, wants = [], []
    for chan, normed in ((2 * kw, True), (vw, False)):  # q and k normed in the epilogue; v
        x, state, w = (rng.standard_normal(s) for s in ((1, chan), (TAPS - 1, chan), (chan, TAPS)))
        qk = conv.Normed(torch.zeros((1, kw), device=DEVICE), torch.zeros((1, kw), device=DEVICE), kw, REAL_DIM, EPS)
        out = torch.zeros((1, chan), device=DEVICE)
        parts.append(conv_parts.Part(f32(x), f32(state), f32(w), out, chan, True, qk if normed else None))
        wants.append(_conv_want(x, state, w, 1))
    conv_parts.conv_parts(parts, rows=1, taps=TAPS)
    torch.cuda.synchronize()
    bound = TAPS * gamma(TAPS + SILU_ROUNDINGS)
    for part, (want, want_state) in zip(parts, wants, strict=True):
        assert rel(part.out, want) <= bound
        assert rel(part.state, want_state) <= gamma(1)
    exact = ref.l2_norm(L2Norm(REAL_K_HEADS, REAL_DIM, EPS), [wants[0][0][:, kw:]], 0).reshape(1, kw)
    assert rel(parts[0].normed.k, exact) <= norm_rel(REAL_DIM) + bound


def _real_launches(rng) -> dict:
    """The three launches at the real widths, each a (run, outputs, state) triple: `run` launches it, `outputs`
    are what it writes, `state` what it reads and writes (put back before each run)."""
    kw, vw = REAL_K_HEADS * REAL_DIM, REAL_V_HEADS * REAL_DIM
    parts = []
    for chan, normed in ((2 * kw, True), (vw, False)):
        x, state, w = (f32(rng.standard_normal(s)) for s in ((1, chan), (TAPS - 1, chan), (chan, TAPS)))
        qk = conv.Normed(torch.zeros((1, kw), device=DEVICE), torch.zeros((1, kw), device=DEVICE), kw, REAL_DIM, EPS)
        out = torch.zeros((1, chan), device=DEVICE)
        parts.append(conv_parts.Part(x, state, w, out, chan, True, qk if normed else None))
    heads, k = REAL_V_HEADS, REAL_EMBD
    x, w = f32(rng.standard_normal((1, k))), f32(rng.standard_normal((2 * heads, k)) / np.sqrt(k))
    dt, coef = f32(rng.standard_normal(heads)), f32(-np.exp(rng.standard_normal(heads)))
    beta, g = torch.zeros((1, heads), device=DEVICE), torch.zeros((1, heads), device=DEVICE)
    o, z, nw = (f32(rng.standard_normal(s)) for s in ((heads, REAL_DIM), (heads, REAL_DIM), (REAL_DIM,)))
    normed, q8 = torch.zeros((heads, REAL_DIM), device=DEVICE), quant.empty_q8(1, heads * REAL_DIM, DEVICE)
    shape = dict(rows=1, heads=heads, key_heads=REAL_K_HEADS, k=k)
    return {
        "conv_parts": (
            lambda: conv_parts.conv_parts(parts, rows=1, taps=TAPS),
            [p.out for p in parts] + [parts[0].normed.q, parts[0].normed.k],
            [p.state for p in parts],
        ),
        "gates": (lambda: gates.projected(x, w, dt, coef, beta, g, **shape), [beta, g], []),
        "gated_norm": (
            lambda: norm.gated_norm(o, nw, z, normed, units=heads, d=REAL_DIM, eps=EPS, out_q8=q8),
            [normed, *q8],
            [],
        ),
    }


@pytest.mark.parametrize("name", ["conv_parts", "gates", "gated_norm"])
@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs an NVIDIA GPU")
def test_each_launch_replays_from_a_cuda_graph_as_it_runs(name):
    run, outputs, states = _real_launches(np.random.default_rng(63))[name]
    start = [s.clone() for s in states]

    def fresh() -> None:
        for s, s0 in zip(states, start, strict=True):
            s.copy_(s0)
        for out in outputs:
            out.zero_()

    run()  # Triton compiles on the first launch, before the capture
    fresh()
    run()
    eager = [out.clone() for out in outputs]
    side = torch.cuda.Stream()  # a run on a side stream before the capture, as torch advises (and the lane does)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    fresh()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outputs, eager, strict=True):
        assert torch.equal(got, want)
