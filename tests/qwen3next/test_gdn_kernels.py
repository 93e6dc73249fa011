"""The cpu lane's gated delta-rule kernels against their definitions, in f64: the chunked rule equals the
recurrence (several chunks, a partial last one, a state carried in, grouped key heads), the convolution equals
its sum over taps with the state standing for the inputs before the first row, and the state after rows fed in
pieces equals the state after them at once."""

from __future__ import annotations

import numpy as np
import pytest

from fuselane.graph.ops import CausalConv, ConvShift, DeltaState, GatedDelta
from fuselane.lanes.cpu.gdn_kernels import CHUNK, causal_conv, chunked, conv_shift, delta_state, gated_delta, recurrence

TOL = 1e-12  # both forms in f64: only the summation order differs
K_HEADS, V_HEADS, DK, DV = 2, 4, 8, 6


def inputs(rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((rows, K_HEADS * DK))
    k = rng.standard_normal((rows, K_HEADS, DK))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).reshape(rows, -1)  # the rule reads L2-normed keys
    v = rng.standard_normal((rows, V_HEADS * DV))
    g = -np.exp(rng.standard_normal((rows, V_HEADS)))  # every head decays
    beta = 1 / (1 + np.exp(-rng.standard_normal((rows, V_HEADS))))
    state = rng.standard_normal((V_HEADS, DK, DV)) * 0.1
    return q, k, v, g, beta, state


def spec(rows: int) -> GatedDelta:
    return GatedDelta(rows, V_HEADS, DK, DV, k_heads=K_HEADS, scale=DK**-0.5)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("rows", [2, CHUNK, 2 * CHUNK + 13])
def test_the_chunked_rule_is_the_recurrence(rows):
    args = inputs(rows)
    out_c, s_c = chunked(spec(rows), *args)
    out_r, s_r = recurrence(spec(rows), *args)
    assert rel(out_c, out_r) <= TOL and rel(s_c, s_r) <= TOL


def test_a_chunk_picks_the_chunked_form_and_a_step_the_recurrence():
    rows = CHUNK + 5
    q, k, v, g, beta, state = inputs(rows, seed=1)
    out = gated_delta(spec(rows), [q, k, v, g, beta, state], 0)
    s = delta_state(DeltaState(spec(rows)), [k, v, g, beta, state], 0)
    steps = []  # the same rows one decode step at a time, the state carried
    for t in range(rows):
        one = spec(1)
        row = [x[t : t + 1] for x in (q, k, v, g, beta)]
        steps.append(gated_delta(one, [*row, state], 0))
        state = delta_state(DeltaState(one), [*row[1:], state], 0)
    assert rel(out, np.concatenate(steps)) <= TOL and rel(s, state) <= TOL


def test_the_rule_is_the_definition_on_one_row():
    q, k, v, g, beta, state = inputs(1, seed=2)
    per = V_HEADS // K_HEADS
    out = gated_delta(spec(1), [q, k, v, g, beta, state], 0).reshape(V_HEADS, DV)
    for h in range(V_HEADS):
        kh, qh = k.reshape(K_HEADS, DK)[h // per], q.reshape(K_HEADS, DK)[h // per] * DK**-0.5
        s = state[h] * np.exp(g[0, h])
        s = s + np.outer(kh, beta[0, h] * (v.reshape(V_HEADS, DV)[h] - s.T @ kh))
        assert np.allclose(out[h], s.T @ qh, rtol=TOL, atol=0)


def test_the_convolution_reads_its_state_then_its_rows():
    rng = np.random.default_rng(4)
    taps, chan, rows = 4, 6, 9
    x, w = rng.standard_normal((rows, chan)), rng.standard_normal((chan, taps))
    state = rng.standard_normal((taps - 1, chan))
    out = causal_conv(CausalConv(rows, chan, taps), [x, state, w], 0)
    seq = np.concatenate([state, x])
    want = np.stack([[seq[t : t + taps, c] @ w[c] for c in range(chan)] for t in range(rows)])
    assert np.allclose(out, want, rtol=TOL, atol=TOL)
    # fed in two pieces, the state carried by the shift: the same rows
    first = causal_conv(CausalConv(5, chan, taps), [x[:5], state, w], 0)
    moved = conv_shift(ConvShift(5, chan, taps - 1), [x[:5], state], 0)
    rest = causal_conv(CausalConv(4, chan, taps), [x[5:], moved, w], 0)
    assert np.allclose(np.concatenate([first, rest]), out, rtol=TOL, atol=TOL)
    assert np.array_equal(conv_shift(ConvShift(1, chan, taps - 1), [x[-1:], seq[-taps:-1]], 0), seq[-taps + 1 :])
