"""The cpu lane's kernels for a gated delta-rule layer: the causal convolution and its state, the L2 norm of
query and key heads, and the gated delta rule itself, as the recurrence (a decode step) or in chunks (a
prefill chunk).

The rule, per value head with state S (dk x dv): S = S * exp(g); S += k (beta (v - S^T k))^T; o = S^T q
(q scaled by 1/sqrt(dk)). The chunked form computes the same rows `CHUNK` at a time: within a chunk, the
delta updates are one unit-lower-triangular system (the WY/UT form), so the state is read and written once
a chunk; it equals the recurrence up to rounding (tests/qwen3next hold it there in f64).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fuselane.graph.ops import CausalConv, ConvShift, DeltaState, GatedDelta, L2Norm

CHUNK = 64  # rows of a chunk of the chunked rule (the Hugging Face and FLA reference's chunk size)


def causal_conv(spec: CausalConv, args: list[np.ndarray], pos: int) -> np.ndarray:
    """Row t of channel c: sum over the taps j of w[c, j] * the (taps - 1 - j)-th input before it, the state's
    rows standing for the inputs before the first."""
    x, state, w = args
    seq = np.concatenate([state.reshape(spec.taps - 1, spec.chan), x.reshape(spec.rows, spec.chan)])
    out = np.zeros((spec.rows, spec.chan), dtype=x.dtype)
    for j in range(spec.taps):
        out += seq[j : j + spec.rows] * w[:, j]
    return out


def conv_shift(spec: ConvShift, args: list[np.ndarray], pos: int) -> np.ndarray:
    """The state after the rows: the last `keep` inputs of the sequence."""
    x, state = args
    seq = np.concatenate([state.reshape(spec.keep, spec.chan), x.reshape(spec.rows, spec.chan)])
    return seq[len(seq) - spec.keep :].copy()


def l2_norm(spec: L2Norm, args: list[np.ndarray], pos: int) -> np.ndarray:
    (x,) = args
    units = x.reshape(spec.rows, spec.cols)
    scale = 1.0 / np.sqrt(np.sum(units * units, axis=-1, keepdims=True) + units.dtype.type(spec.eps))
    return (units * scale).reshape(x.shape)


def _heads(spec: GatedDelta, q, k, v, g, beta) -> tuple[np.ndarray, ...]:
    """Per row and value head: q (scaled) and k of its key head, v, g and beta."""
    rows, nv, per = spec.rows, spec.heads, spec.heads // spec.key_heads

    def expand(x):
        return None if x is None else np.repeat(x.reshape(rows, spec.key_heads, spec.dk), per, axis=1)

    qh = expand(q)
    if qh is not None:
        qh = qh * qh.dtype.type(spec.scale)
    return qh, expand(k), v.reshape(rows, nv, spec.dv), g.reshape(rows, nv), beta.reshape(rows, nv)


def recurrence(spec: GatedDelta, q, k, v, g, beta, state) -> tuple[np.ndarray | None, np.ndarray]:
    """The rule row by row: the output (rows, heads * dv) (None without q) and the state after the rows."""
    qh, kh, vh, gh, bh = _heads(spec, q, k, v, g, beta)
    s = state.reshape(spec.heads, spec.dk, spec.dv).copy()
    out = np.empty_like(vh) if qh is not None else None
    for t in range(spec.rows):
        s *= np.exp(gh[t])[:, None, None]
        remembered = np.einsum("hkv,hk->hv", s, kh[t])
        delta = (vh[t] - remembered) * bh[t][:, None]
        s += kh[t][:, :, None] * delta[:, None, :]
        if out is not None:
            out[t] = np.einsum("hkv,hk->hv", s, qh[t])
    return (None if out is None else out.reshape(spec.rows, -1)), s


def _unit_lower_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """X with (I + strictly_lower(a)) X = b, by forward substitution over the chunk's rows (a: (h, c, c))."""
    x = np.empty_like(b)
    for i in range(a.shape[-1]):
        x[:, i] = b[:, i] - np.einsum("hj,hj...->h...", a[:, i, :i], x[:, :i])
    return x


def chunked(spec: GatedDelta, q, k, v, g, beta, state) -> tuple[np.ndarray | None, np.ndarray]:
    """The rule `CHUNK` rows at a time (the rows padded with rows that change nothing: k = 0, g = 0)."""
    qh, kh, vh, gh, bh = _heads(spec, q, k, v, g, beta)
    pad = -spec.rows % CHUNK

    def padded(x):  # (rows, heads, ...) -> (chunks, heads, CHUNK, ...)
        x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), dtype=x.dtype)])
        x = x.reshape(-1, CHUNK, *x.shape[1:])
        return np.moveaxis(x, 2, 1)

    kc, vc, gc, bc = padded(kh), padded(vh), padded(gh), padded(bh)
    qc = padded(qh) if qh is not None else None
    s = state.reshape(spec.heads, spec.dk, spec.dv).copy()
    later = np.tril(np.ones((CHUNK, CHUNK), dtype=bool))
    outs = []
    for c in range(kc.shape[0]):
        cum = np.cumsum(gc[c], axis=-1)  # (h, C): the log of the decay from the chunk's start to each row
        decay = np.where(later, np.exp(np.where(later, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)
        kb = kc[c] * bc[c][..., None]
        system = (kb @ np.swapaxes(kc[c], -1, -2)) * decay
        new_v = _unit_lower_solve(system, vc[c] * bc[c][..., None])
        k_decayed = _unit_lower_solve(system, kb * np.exp(cum)[..., None])
        v_new = new_v - k_decayed @ s  # (h, C, dv): each row's correction beyond what the state predicts
        if qc is not None:
            inner = (qc[c] @ np.swapaxes(kc[c], -1, -2)) * decay
            outs.append((qc[c] * np.exp(cum)[..., None]) @ s + inner @ v_new)
        to_end = np.exp(cum[:, -1:] - cum)[..., None]  # each row's decay to the chunk's end
        s = s * np.exp(cum[:, -1])[:, None, None] + np.swapaxes(kc[c] * to_end, -1, -2) @ v_new
    if qc is None:
        return None, s
    out = np.concatenate([np.moveaxis(o, 0, 1) for o in outs])[: spec.rows]  # (rows, h, dv)
    return out.reshape(spec.rows, -1), s


def _rule(spec: GatedDelta) -> Callable[..., tuple[np.ndarray | None, np.ndarray]]:
    return recurrence if spec.rows == 1 else chunked


def gated_delta(spec: GatedDelta, args: list[np.ndarray], pos: int) -> np.ndarray:
    """The rule's output for each row (ins: q, k, v, g, beta, state)."""
    out, _ = _rule(spec)(spec, *args)
    return out


def delta_state(spec: DeltaState, args: list[np.ndarray], pos: int) -> np.ndarray:
    """The state after the rows (ins: k, v, g, beta, state)."""
    k, v, g, beta, state = args
    _, s = _rule(spec.rule)(spec.rule, None, k, v, g, beta, state)
    return s


GDN_KERNELS: dict[type, Callable[..., np.ndarray]] = {
    CausalConv: causal_conv,
    ConvShift: conv_shift,
    L2Norm: l2_norm,
    GatedDelta: gated_delta,
    DeltaState: delta_state,
}
