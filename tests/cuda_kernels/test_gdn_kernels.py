"""The gated delta-rule kernels (`triton.gdn`) and the partial rotary of the rope kernel against the cpu lane's
kernels in f64, at tiny shapes, under the interpreter on a CPU.

Bounds (Higham 3.1, gamma_k as kernel_checks): a convolution output is a sum of `taps` f32 products, then a SiLU
(a sigmoid's exponential and division: a few roundings more), within gamma(taps + SILU_ROUNDINGS) of the sum of
|w x| (bounded here by the largest |output| times the taps); an L2-normed head within norm_rel of its length.
The delta rule's state after t rows carries each row's dk-term dot product, its decay and its rank-one update:
within gamma(t * (dk + STEP_ROUNDINGS)) of the largest |value|, the output one dot more. A bf16 state is
rounded once, where the kernel writes it back: within bf16's unit roundoff of each value, plus the f32 bound.
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

from fuselane.graph.ops import CausalConv, ConvShift, GatedDelta, L2Norm, Rope  # noqa: E402
from fuselane.lanes.cpu import gdn_kernels as ref  # noqa: E402
from fuselane.lanes.cpu.kernels import rope as ref_rope  # noqa: E402
from fuselane.lanes.cuda.plan import attn_kernels, kernels  # noqa: E402
from fuselane.lanes.cuda.triton import rope  # noqa: E402
from fuselane.lanes.cuda.triton.gdn import chunked, conv, delta, gates, norm  # noqa: E402
from fuselane.numerics.contract import Keep  # noqa: E402

SILU_ROUNDINGS = 8  # the sigmoid's exponential (approximate on a GPU: 4u), its add and division, the product
# the blocked solve's products past the forward substitution: N = D a_o, the series' powers, the series times D
BLOCK_SOLVE_PRODUCTS = chunked.CHUNK // chunked.SOLVE_BLOCK + 1
STEP_ROUNDINGS = 8  # a row's decay (exponential and product), the difference, beta's product, the update's add
K_HEADS, V_HEADS, DK, DV, TAPS = 2, 4, 16, 48, 4  # DV past one block of `delta.BV` columns: a partial block too
EPS = 1e-6


def rel(a, b) -> float:
    a = a.detach().cpu().double().numpy() if isinstance(a, torch.Tensor) else a
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("rows", [1, 2, 5, conv.ROW_TILE + 3])  # fewer rows than the state's; past a row block
@pytest.mark.parametrize("normed", [True, False])
def test_conv_silu_l2norm_and_the_state_shift_in_one_launch(rows, normed):
    rng = np.random.default_rng(rows)
    kw, vw = K_HEADS * DK, V_HEADS * DK
    chan = 2 * kw + vw
    x, state, w = (
        rng.standard_normal((rows, chan)),
        rng.standard_normal((TAPS - 1, chan)),
        rng.standard_normal((chan, TAPS)),
    )
    want = silu(ref.causal_conv(CausalConv(rows, chan, TAPS), [x, state, w], 0))
    want_state = ref.conv_shift(ConvShift(rows, chan, TAPS - 1), [x, state], 0)
    out, st = torch.zeros((rows, chan), device=DEVICE), dev(state.astype(np.float32))
    q, k = torch.zeros((rows, kw), device=DEVICE), torch.zeros((rows, kw), device=DEVICE)
    heads = conv.Normed(q, k, kw, DK, EPS) if normed else None
    conv.conv(dev(x.astype(np.float32)), st, dev(w.astype(np.float32)), out, rows=rows, chan=chan, taps=TAPS,
              silu=True, shift=True, normed=heads)  # fmt: skip
    assert rel(out, want) <= TAPS * gamma(TAPS + SILU_ROUNDINGS)
    assert rel(st, want_state) <= gamma(1)  # moved, not computed: the f32 inputs themselves
    if normed:
        l2 = L2Norm(rows * K_HEADS, DK, EPS)
        for got, part in ((q, want[:, :kw]), (k, want[:, kw : 2 * kw])):
            exact = ref.l2_norm(l2, [part], 0).reshape(rows, kw)
            assert rel(got, exact) <= norm_rel(DK) + TAPS * gamma(TAPS + SILU_ROUNDINGS)


def test_the_state_shift_alone_moves_the_state_by_the_rows():
    rng = np.random.default_rng(3)
    rows, chan = 2, 40
    x, state = rng.standard_normal((rows, chan)), rng.standard_normal((TAPS - 1, chan))
    st = dev(state.astype(np.float32))
    conv.conv(dev(x.astype(np.float32)), st, st, None, rows=rows, chan=chan, taps=TAPS, silu=False, shift=True)
    assert rel(st, ref.conv_shift(ConvShift(rows, chan, TAPS - 1), [x, state], 0)) <= gamma(1)


def _rule_inputs(rows: int, rng):
    q = rng.standard_normal((rows, K_HEADS * DK))
    k = rng.standard_normal((rows, K_HEADS, DK))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).reshape(rows, -1)
    v = rng.standard_normal((rows, V_HEADS * DV))
    g = -np.exp(rng.standard_normal((rows, V_HEADS)))
    beta = 1 / (1 + np.exp(-rng.standard_normal((rows, V_HEADS))))
    state = rng.standard_normal((V_HEADS, DK, DV)) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("keep", [Keep.F32, Keep.BF16])
@pytest.mark.parametrize("rows", [1, 6])
def test_the_delta_rule_over_every_head_in_one_launch(rows, keep):
    rng = np.random.default_rng(10 + rows)
    q, k, v, g, beta, state = _rule_inputs(rows, rng)
    dtype = torch.float32 if keep is Keep.F32 else torch.bfloat16
    st = torch.from_numpy(state).to(dtype).to(DEVICE)
    state = st.double().cpu().numpy()  # the rule starts from the state as kept
    spec = GatedDelta(rows, V_HEADS, DK, DV, k_heads=K_HEADS, scale=DK**-0.5)
    want_o, want_s = ref.recurrence(spec, q, k, v, g, beta, state)
    out = torch.zeros((rows, V_HEADS * DV), device=DEVICE)
    f32 = lambda a: dev(a.astype(np.float32))  # noqa: E731
    delta.delta(f32(q), f32(k), f32(v), f32(g), f32(beta), st, out, rows=rows, heads=V_HEADS, key_heads=K_HEADS,
                dk=DK, dv=DV, scale=spec.scale, write_state=True)  # fmt: skip
    bound = gamma(rows * (DK + STEP_ROUNDINGS))
    assert rel(out, want_o) <= bound + gamma(DK + 1)
    got_s = st.double().cpu().numpy()
    assert np.all(np.abs(got_s - want_s) <= keep.unit_roundoff * np.abs(want_s) + bound * np.abs(want_s).max())


def test_the_rules_output_alone_leaves_the_state_and_the_state_alone_writes_no_output():
    rng = np.random.default_rng(4)
    rows = 2
    q, k, v, g, beta, state = _rule_inputs(rows, rng)
    spec = GatedDelta(rows, V_HEADS, DK, DV, k_heads=K_HEADS, scale=DK**-0.5)
    want_o, want_s = ref.recurrence(spec, q, k, v, g, beta, state)
    f32 = lambda a: dev(a.astype(np.float32))  # noqa: E731
    st, out = f32(state), torch.zeros((rows, V_HEADS * DV), device=DEVICE)
    shape = dict(rows=rows, heads=V_HEADS, key_heads=K_HEADS, dk=DK, dv=DV, scale=spec.scale)
    delta.delta(f32(q), f32(k), f32(v), f32(g), f32(beta), st, out, write_state=False, **shape)
    assert torch.equal(st, f32(state))
    delta.delta(None, f32(k), f32(v), f32(g), f32(beta), st, None, write_state=True, **shape)
    bound = gamma(rows * (DK + STEP_ROUNDINGS))
    assert rel(out, want_o) <= bound + gamma(DK + 1)
    assert rel(st, want_s) <= bound


def test_the_gates_read_b_and_a_out_of_the_projection():
    rng = np.random.default_rng(5)
    rows, per = 3, V_HEADS // K_HEADS
    ba = rng.standard_normal((rows * K_HEADS, 2 * per)) * 4
    dt, a_coef = rng.standard_normal(V_HEADS), -np.exp(rng.standard_normal(V_HEADS))
    flat = dev(ba.astype(np.float32)).reshape(-1)
    b_view = flat.as_strided((rows * K_HEADS, per), (2 * per, 1))
    a_view = flat[per:].as_strided((rows * K_HEADS, per), (2 * per, 1))
    beta, g = torch.zeros((rows, V_HEADS), device=DEVICE), torch.zeros((rows, V_HEADS), device=DEVICE)
    gates.gates(b_view, a_view, dev(dt.astype(np.float32)), dev(a_coef.astype(np.float32)), beta, g, rows=rows,
                heads=V_HEADS, key_heads=K_HEADS)  # fmt: skip
    b, a = ba[:, :per].reshape(rows, V_HEADS), ba[:, per:].reshape(rows, V_HEADS)
    assert rel(beta, 1 / (1 + np.exp(-b))) <= gamma(SILU_ROUNDINGS)
    assert rel(g, a_coef * np.logaddexp(0, a + dt)) <= gamma(SILU_ROUNDINGS)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_step_makes_its_gates_from_b_and_a_as_the_gates_launch_does(rows):
    # `gates_in_step`: the step's programs make beta and g from the projection's b and a themselves; the same
    # f32 operations as the gates launch, so the output and the state are those of the two launches, bit for bit
    rng = np.random.default_rng(20 + rows)
    per = V_HEADS // K_HEADS
    q, k, v, _, _, state = _rule_inputs(rows, rng)
    flat = dev((rng.standard_normal((rows * K_HEADS, 2 * per)) * 4).astype(np.float32)).reshape(-1)
    b_view = flat.as_strided((rows * K_HEADS, per), (2 * per, 1))
    a_view = flat[per:].as_strided((rows * K_HEADS, per), (2 * per, 1))
    dt, coef = (
        dev(x.astype(np.float32)) for x in (rng.standard_normal(V_HEADS), -np.exp(rng.standard_normal(V_HEADS)))
    )
    f32 = lambda a: dev(a.astype(np.float32))  # noqa: E731
    shape = dict(rows=rows, heads=V_HEADS, key_heads=K_HEADS, dk=DK, dv=DV, scale=DK**-0.5, write_state=True)
    beta, g = torch.zeros((rows, V_HEADS), device=DEVICE), torch.zeros((rows, V_HEADS), device=DEVICE)
    gates.gates(b_view, a_view, dt, coef, beta, g, rows=rows, heads=V_HEADS, key_heads=K_HEADS)
    apart_s, apart_o = f32(state), torch.zeros((rows, V_HEADS * DV), device=DEVICE)
    delta.delta(f32(q), f32(k), f32(v), g, beta, apart_s, apart_o, **shape)
    made_s, made_o = f32(state), torch.zeros((rows, V_HEADS * DV), device=DEVICE)
    delta.delta(f32(q), f32(k), f32(v), delta.Raw(b_view, a_view, dt, coef), None, made_s, made_o, **shape)
    assert torch.equal(made_o, apart_o) and torch.equal(made_s, apart_s)


@pytest.mark.parametrize(("rows", "dv"), [(1, 64), (3, 64), (1, 48)])  # 48: not whole blocks, no int8 form
def test_the_step_norms_its_output_as_the_norms_launch_does(rows, dv):
    # `norm_in_step`: a program holds a head's whole value width and writes norm(o) * w * silu(z) (and its int8
    # form) in its store; the numbers of the step then the gated norm's launch, within the rule's and the norm's
    # bounds of the f64 reference (bit for bit under the interpreter, whose sums do not depend on the tiling)
    from fuselane.lanes.cuda.triton import quant

    rng = np.random.default_rng(30 + rows + dv)
    q, k, _, g, beta, _ = _rule_inputs(rows, rng)
    v, state = rng.standard_normal((rows, V_HEADS * dv)), rng.standard_normal((V_HEADS, DK, dv)) * 0.1
    z, w = rng.standard_normal((rows, V_HEADS * dv)), rng.standard_normal(dv)
    f32 = lambda a: dev(a.astype(np.float32))  # noqa: E731
    shape = dict(rows=rows, heads=V_HEADS, key_heads=K_HEADS, dk=DK, dv=dv, scale=DK**-0.5, write_state=True)
    q8 = [quant.empty_q8(rows, V_HEADS * dv, DEVICE) if dv % quant.QK == 0 else None for _ in range(2)]
    apart_s, o, apart_y = f32(state), *(torch.zeros((rows, V_HEADS * dv), device=DEVICE) for _ in range(2))
    delta.delta(f32(q), f32(k), f32(v), f32(g), f32(beta), apart_s, o, **shape)
    norm.gated_norm(o, f32(w), f32(z), apart_y, units=rows * V_HEADS, d=dv, eps=EPS, out_q8=q8[0])
    made_s, made_y = f32(state), torch.zeros((rows, V_HEADS * dv), device=DEVICE)
    normed = delta.Normed(f32(w), f32(z), EPS, q8[1])
    delta.delta(f32(q), f32(k), f32(v), f32(g), f32(beta), made_s, made_y, normed=normed, **shape)
    spec = GatedDelta(rows, V_HEADS, DK, dv, k_heads=K_HEADS, scale=DK**-0.5)
    want_o, want_s = ref.recurrence(spec, q, k, v, g, beta, state)
    wo, zs = want_o.reshape(rows * V_HEADS, dv), z.reshape(rows * V_HEADS, dv)
    want = wo / np.sqrt(np.mean(wo * wo, axis=-1, keepdims=True) + EPS) * w * silu(zs)
    bound = gamma(rows * (DK + STEP_ROUNDINGS))
    assert rel(made_s, want_s) <= bound
    assert rel(made_y.reshape(want.shape), want) <= bound + gamma(DK + 1) + norm_rel(dv) + gamma(SILU_ROUNDINGS)
    if DEVICE == "cpu":
        assert torch.equal(made_s, apart_s) and torch.equal(made_y, apart_y)
        if q8[0] is not None:
            assert all(torch.equal(getattr(q8[0], f), getattr(q8[1], f)) for f in ("q", "d", "s"))
    with pytest.raises(ValueError, match="at most"):
        wide = dict(shape, dv=2 * kernels.GDN_NORM_MOST_DV)
        delta.delta(f32(q), f32(k), f32(v), f32(g), f32(beta), made_s, made_y, normed=normed, **wide)


def test_the_gated_norm_and_a_strided_l2_norm():
    rng = np.random.default_rng(6)
    units, d = 6, DV
    x, z, w = rng.standard_normal((units, d)), rng.standard_normal((units, d)), rng.standard_normal(d)
    out = torch.zeros((units, d), device=DEVICE)
    f32 = lambda a: dev(a.astype(np.float32))  # noqa: E731
    norm.gated_norm(f32(x), f32(w), f32(z), out, units=units, d=d, eps=EPS)
    want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w * silu(z)
    assert rel(out, want) <= norm_rel(d) + gamma(SILU_ROUNDINGS)
    rows, chan = 2, 3 * K_HEADS * DK
    wide = rng.standard_normal((rows, chan))
    view = f32(wide)[:, K_HEADS * DK : 2 * K_HEADS * DK]  # the keys' slice of a wider row
    normed = torch.zeros((rows * K_HEADS, DK), device=DEVICE)
    norm.l2_norm(view, normed, units=rows * K_HEADS, d=DK, eps=EPS)
    part = wide[:, K_HEADS * DK : 2 * K_HEADS * DK]
    assert rel(normed, ref.l2_norm(L2Norm(rows * K_HEADS, DK, EPS), [part], 0).reshape(-1, DK)) <= norm_rel(DK)


@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("rows", [2, attn_kernels.ROPE_ONE_HEAD_ROWS + 3])
def test_a_partial_rotary_turns_the_first_values_of_each_head(apart, rows):
    # past a decode step's rows a program takes a tile of rows and heads; a partial rotary's head (4 turned
    # values and 12 not, in tiles of 4 and 16) is no power of two wide, its tile's sides must be
    rng = np.random.default_rng(7)
    heads, hd, rot, pos = 3, 16, 4, 37
    x = rng.standard_normal((rows, heads, 2 * hd if apart else hd))  # apart: each head followed by its gate
    xt = dev(x.astype(np.float32))
    src = xt[..., :hd] if apart else xt.reshape(rows, heads * hd)
    out = torch.zeros((rows, heads * hd), device=DEVICE)
    rope.qk_norm_rope(src, out, dev(np.array([pos], dtype=np.int32)), heads=heads, hd=hd, base=1e4, rot=rot)
    want = ref_rope(Rope(rows, heads, hd, 1e4, rot=rot), [x[..., :hd].reshape(rows, -1)], pos)
    assert rel(out, want) <= (pos + rows) * gamma(4)  # the angle's f32 product at its position, cos, sin, a dot


@pytest.mark.parametrize(
    ("keep", "precision", "solve", "form"),
    [(Keep.F32, "ieee", "rows", "split"), (Keep.BF16, "ieee", "rows", "split"), (Keep.F32, "tf32x3", "rows", "split"),
     (Keep.F32, "ieee", "blocks", "split"), (Keep.F32, "tf32x3", "blocks", "split"),
     (Keep.F32, "ieee", "rows", "whole"), (Keep.BF16, "tf32x3", "blocks", "whole")],
)  # fmt: skip
@pytest.mark.parametrize("rows", [5, chunked.CHUNK + 3])
def test_the_chunked_rule_equals_the_recurrence(rows, keep, precision, solve, form):
    rng = np.random.default_rng(20 + rows)
    q, k, v, g, beta, state = _rule_inputs(rows, rng)
    dtype = torch.float32 if keep is Keep.F32 else torch.bfloat16
    st = torch.from_numpy(state).to(dtype).to(DEVICE)
    spec = GatedDelta(rows, V_HEADS, DK, DV, k_heads=K_HEADS, scale=DK**-0.5)
    want_o, want_s = ref.recurrence(spec, q, k, v, g, beta, st.double().cpu().numpy())
    out = torch.zeros((rows, V_HEADS * DV), device=DEVICE)
    f32 = lambda a: dev(a.astype(np.float32))  # noqa: E731
    chunked.chunked(f32(q), f32(k), f32(v), f32(g), f32(beta), st, out, rows=rows, heads=V_HEADS,
                    key_heads=K_HEADS, dk=DK, dv=DV, scale=spec.scale, write_state=True,
                    precision=precision, solve=solve, form=form)  # fmt: skip
    # a chunk's products and its triangular solve (a row of the inverse a sum over the rows before it) in f32;
    # the solve in blocks takes products of the chunk's width more (`BLOCK_SOLVE_PRODUCTS`); TF32x3 products
    # round at their own unit (`chunked.TF32X3_ROUNDOFF`)
    solve_terms = BLOCK_SOLVE_PRODUCTS * chunked.CHUNK if solve == "blocks" else 0
    bound = gamma(rows * (DK + STEP_ROUNDINGS) + chunked.CHUNK * (DK + DV) + solve_terms)
    if precision == "tf32x3":
        bound *= chunked.TF32X3_ROUNDOFF / Keep.F32.unit_roundoff
    assert rel(out, want_o) <= bound
    got_s = st.double().cpu().numpy()
    assert np.all(np.abs(got_s - want_s) <= keep.unit_roundoff * np.abs(want_s) + bound * np.abs(want_s).max())


@pytest.mark.parametrize("rows", [1, 3])
def test_the_attention_gates_its_output_in_the_store(rows):
    """AttnOutputGate: the attention's output times sigmoid(gate), the gate read between the query's heads."""
    from fuselane.lanes.cuda.triton.attention import decode, prefill

    rng = np.random.default_rng(8 + rows)
    heads, kv, hd, pos = 4, 2, 16, 5
    f32 = lambda a: dev(a.astype(np.float32))  # noqa: E731
    qg = f32(rng.standard_normal((rows, heads, 2 * hd)))  # each head's query, then its gate
    q, gate = qg[..., :hd].contiguous().view(rows, -1), qg[..., hd:]
    kc, vc = f32(rng.standard_normal((16, kv * hd))), f32(rng.standard_normal((16, kv * hd)))
    p = dev(np.array([pos], dtype=np.int32))
    plain, gated = torch.zeros((rows, heads * hd), device=DEVICE), torch.zeros((rows, heads * hd), device=DEVICE)
    shape = dict(heads=heads, kv_heads=kv, hd=hd, scale=hd**-0.5)
    if rows == 1:
        for out, g in ((plain, None), (gated, gate[0])):  # one row: (heads, hd), heads 2 hd apart
            decode.flash_decode(q, kc, vc, p, out, scratch=decode.decode_scratch(heads, hd, 16, DEVICE), gate=g,
                                **shape)  # fmt: skip
    else:
        for out, g in ((plain, None), (gated, gate)):
            prefill.flash_prefill(q, kc, vc, p, out, rows=rows, gate=g, **shape)
    want = plain.double().cpu().numpy() * (1 / (1 + np.exp(-gate.double().cpu().numpy().reshape(rows, -1))))
    assert rel(gated, want) <= gamma(SILU_ROUNDINGS)
