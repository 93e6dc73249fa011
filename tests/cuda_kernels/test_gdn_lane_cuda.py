"""The cuda lane's gated delta-rule kernels and the whole lane on the GPU, compiled, at Qwen3-Next-80B-A3B's
widths: the delta step over 32 value heads of 128 (16 key heads), as the recurrence and in chunks, and the
convolution over 8192 channels with its 128-value heads normed in the epilogue, against the cpu lane's kernels
in f64; and the lane on four layers of the real shape (three gated delta-rule layers, one gated full-attention
layer; 16 experts rather than 512, a small vocabulary) against the cpu lane in f64: a prompt past one chunk,
then decode steps (the third and later replayed as a captured CUDA graph, which must not move the states
twice), under both `state` precisions, and the device decode loop's greedy tokens where the reference's pick is
clear; and a prompt of a 512-row session chunk and a partial one. Bounds as in test_gdn_kernels.py and the lane's
numerics contract.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernel_checks import CUDA, DEVICE, dev, gamma, norm_rel  # noqa: E402
from test_gdn_kernels import BLOCK_SOLVE_PRODUCTS, SILU_ROUNDINGS, STEP_ROUNDINGS, rel, silu  # noqa: E402

from fuselane.gguf.synth import SHAPES, write_synthetic  # noqa: E402
from fuselane.graph.ops import CausalConv, ConvShift, GatedDelta, L2Norm  # noqa: E402
from fuselane.lanes.cpu import gdn_kernels as ref  # noqa: E402
from fuselane.numerics.contract import Keep  # noqa: E402
from fuselane.runtime.sampling import GREEDY  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")]

K_HEADS, V_HEADS, DIM, TAPS = 16, 32, 128, 4
CHUNK_PAST = 70  # prompt rows: past one 64-row chunk of the cpu lane's chunked rule
SHAPE = replace(SHAPES["qwen3-next-80b-a3b"], n_layers=4, vocab=512, experts=16)
DECODES = 4  # the third decode step is captured, the fourth replayed
EPS = 1e-6


@pytest.mark.parametrize("keep", [Keep.F32, Keep.BF16])
@pytest.mark.parametrize(
    ("rows", "form"),
    [(1, "delta"), (CHUNK_PAST, "delta"), (CHUNK_PAST, "chunked"), (CHUNK_PAST, "tf32x3"), (CHUNK_PAST, "blocks")],
)
def test_the_delta_step_at_the_real_widths(rows, form, keep):
    rng = np.random.default_rng(rows)
    q = rng.standard_normal((rows, K_HEADS * DIM))
    k = rng.standard_normal((rows, K_HEADS, DIM))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).reshape(rows, -1)
    v = rng.standard_normal((rows, V_HEADS * DIM))
    g = -np.exp(rng.standard_normal((rows, V_HEADS)))
    beta = 1 / (1 + np.exp(-rng.standard_normal((rows, V_HEADS))))
    dtype = torch.float32 if keep is Keep.F32 else torch.bfloat16
    st = torch.from_numpy(rng.standard_normal((V_HEADS, DIM, DIM)) * 0.1).to(dtype).to(DEVICE)
    spec = GatedDelta(rows, V_HEADS, DIM, DIM, k_heads=K_HEADS, scale=DIM**-0.5)
    want_o, want_s = ref.recurrence(spec, q, k, v, g, beta, st.double().cpu().numpy())
    from fuselane.lanes.cuda.triton.gdn import chunked, delta

    # "chunked" multiplies in f32, "tf32x3" in three TF32 products a step (`CudaKnobs.delta_products`), "blocks"
    # too, its system solved in blocks (`chunked.SOLVES`)
    precision = {"chunked": "ieee", "tf32x3": "tf32x3", "blocks": "tf32x3"}.get(form)
    solve = "blocks" if form == "blocks" else "rows"
    run = delta.delta if form == "delta" else partial(chunked.chunked, precision=precision, solve=solve)
    out = torch.zeros((rows, V_HEADS * DIM), device=DEVICE)
    f32 = lambda a: dev(a.astype(np.float32))  # noqa: E731
    run(f32(q), f32(k), f32(v), f32(g), f32(beta), st, out, rows=rows, heads=V_HEADS, key_heads=K_HEADS,
                dk=DIM, dv=DIM, scale=spec.scale, write_state=True)  # fmt: skip
    torch.cuda.synchronize()
    solve_terms = BLOCK_SOLVE_PRODUCTS * chunked.CHUNK if form == "blocks" else 0
    # as the kernel tests
    bound = gamma(rows * (DIM + STEP_ROUNDINGS) + chunked.CHUNK * 2 * DIM + solve_terms) + gamma(DIM + 1)
    if form in ("tf32x3", "blocks"):
        bound *= chunked.TF32X3_ROUNDOFF / Keep.F32.unit_roundoff
    assert rel(out, want_o) <= bound
    got_s = st.double().cpu().numpy()
    assert np.all(np.abs(got_s - want_s) <= keep.unit_roundoff * np.abs(want_s) + bound * np.abs(want_s).max())


@pytest.mark.parametrize("rows", [1, CHUNK_PAST])
def test_the_convolution_at_the_real_widths(rows):
    from fuselane.lanes.cuda.triton.gdn import conv

    rng = np.random.default_rng(rows + 1)
    kw = K_HEADS * DIM
    chan = 2 * kw + V_HEADS * DIM
    x, state, w = (rng.standard_normal(s) for s in ((rows, chan), (TAPS - 1, chan), (chan, TAPS)))
    want = silu(ref.causal_conv(CausalConv(rows, chan, TAPS), [x, state, w], 0))
    out, st = torch.zeros((rows, chan), device=DEVICE), dev(state.astype(np.float32))
    q, k = torch.zeros((rows, kw), device=DEVICE), torch.zeros((rows, kw), device=DEVICE)
    conv.conv(dev(x.astype(np.float32)), st, dev(w.astype(np.float32)), out, rows=rows, chan=chan, taps=TAPS,
              silu=True, shift=True, normed=conv.Normed(q, k, kw, DIM, EPS))  # fmt: skip
    torch.cuda.synchronize()
    assert rel(out, want) <= TAPS * gamma(TAPS + SILU_ROUNDINGS)
    assert rel(st, ref.conv_shift(ConvShift(rows, chan, TAPS - 1), [x, state], 0)) <= gamma(1)
    exact = ref.l2_norm(L2Norm(rows * K_HEADS, DIM, EPS), [want[:, kw : 2 * kw]], 0).reshape(rows, kw)
    assert rel(k, exact) <= norm_rel(DIM) + TAPS * gamma(TAPS + SILU_ROUNDINGS)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(write_synthetic(tmp_path_factory.mktemp("q3n") / "m.gguf", SHAPE, "q4_k_m", seed=5))


@pytest.fixture(scope="module")
def reference(model_path):
    """The cpu lane's logits in f64: the prompt's last row, then each decode step's."""
    from fuselane.runtime.model import load

    ref_model = load(model_path, lane="cpu", ctx=128, dtype=np.float64)
    prompt = np.random.default_rng(2).integers(0, SHAPE.vocab, CHUNK_PAST).tolist()
    s = ref_model.session()
    logits = [s.feed(prompt)]
    fed = list(range(11, 11 + DECODES))
    logits += [s.extend([t]) for t in fed]
    return prompt, fed, logits


@pytest.mark.xdist_group("qwen3next-lane")
@pytest.mark.parametrize("state", ["f32", "bf16"])
def test_the_lane_runs_the_real_shape_as_the_cpu_lane(model_path, reference, state):
    from fuselane.runtime.model import load

    prompt, fed, want = reference
    gpu = load(model_path, lane="cuda", ctx=128, knobs=[f"state={state}"])
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    s = gpu.session()
    got = [s.feed(prompt)] + [s.extend([t]) for t in fed]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rel(a, b) <= tol, f"step {i}: {rel(a, b):.2e} > {tol:.2e}"


@pytest.mark.xdist_group("qwen3next-lane")
def test_a_long_prompt_runs_in_the_lanes_chunks_as_the_cpu_lane(model_path):
    # a session takes the hybrid's prompt 512 rows at a time (`CudaLane.prefill_chunk`, for its mixture): a full
    # chunk (eight of the chunked rule's 64 rows, the state carried between them in the program), then 88 rows
    from fuselane.lanes.cuda.plan import kernels
    from tests.long_prompt import feed_both

    long = kernels.MOE_CHUNK_ROWS + 88
    tokens = np.random.default_rng(4).integers(0, SHAPE.vocab, long).tolist()
    got, want, tol, chunk = feed_both(model_path, tokens)
    assert chunk == kernels.MOE_CHUNK_ROWS
    assert np.isfinite(got).all() and rel(got, want) <= tol, f"{rel(got, want):.2e} > {tol:.2e}"


@pytest.mark.xdist_group("qwen3next-lane")
def test_the_device_decode_loop_feeds_each_token_once(model_path, reference):
    """Greedy tokens of the device loop (a graph replay a token, no step run ahead) equal the cpu lane's
    greedy picks wherever the reference's best logit leads the next by more than the contract's bound."""
    from fuselane.runtime.model import load

    prompt, _, _ = reference
    gpu = load(model_path, lane="cuda", ctx=128)
    cpu = load(model_path, lane="cpu", ctx=128, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    s = gpu.session()
    last = s.prepare(prompt)
    loop = gpu.lane.decode(prompt[-1], last, GREEDY)
    tokens = [next(loop) for _ in range(DECODES)]
    rs = cpu.session()
    logits = rs.feed(prompt)
    for t in tokens:
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] > 2 * tol * np.max(np.abs(logits)):
            assert t == int(np.argmax(logits))
        logits = rs.extend([t])
