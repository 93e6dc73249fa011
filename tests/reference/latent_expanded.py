"""deepseek2 run expanded, in NumPy: each head's keys and values expanded from the cached latents (the key
half's `nope` values then the shared rotated key; the value half's `vdim` values), and each head's query over
them. Everything but the attention's form is the cpu lane's own kernels (norms, rotations, routing), so a
comparison with the lane's absorbed run isolates the absorption.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fuselane.graph.ops import ExpertChoice, GroupedTopK, RmsNorm, Rope, RouteWeights, TopK
from fuselane.lanes.cpu.kernels import rms_norm, rope
from fuselane.lanes.cpu.latent_kernels import expert_choice, grouped_top_k
from fuselane.lanes.cpu.moe_kernels import route_weights, top_k
from fuselane.models.config import ModelConfig


def _norm(cfg: ModelConfig, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return rms_norm(RmsNorm(len(x), x.shape[-1], cfg.rms_eps), [x], 0) * w


def _rotate(cfg: ModelConfig, x: np.ndarray, heads: int) -> np.ndarray:
    lt = cfg.latent
    spec = Rope(len(x), heads, lt.rope, cfg.rope_base, half=False, yarn=lt.yarn)
    return rope(spec, [x.reshape(len(x), -1)], 0).reshape(len(x), heads, lt.rope)


def _attention(cfg: ModelConfig, w: Mapping[str, np.ndarray], b: str, h: np.ndarray) -> np.ndarray:
    lt, t, heads = cfg.latent, len(h), cfg.n_heads
    if lt.q_lora:
        q = _norm(cfg, h @ w[b + "attn_q_a.weight"].T, w[b + "attn_q_a_norm.weight"]) @ w[b + "attn_q_b.weight"].T
    else:
        q = h @ w[b + "attn_q.weight"].T
    q = q.reshape(t, heads, lt.qk)
    q = np.concatenate([q[..., : lt.nope], _rotate(cfg, q[..., lt.nope :], heads)], axis=-1)
    kv = h @ w[b + "attn_kv_a_mqa.weight"].T
    latent = _norm(cfg, kv[:, : lt.kv_lora], w[b + "attn_kv_a_norm.weight"])
    k_pe = _rotate(cfg, kv[:, lt.kv_lora :], 1)
    keys = np.einsum("tl,hln->thn", latent, w[b + "attn_k_b.weight"])  # the key half: (heads, kv_lora, nope)
    keys = np.concatenate([keys, np.broadcast_to(k_pe, (t, heads, lt.rope))], axis=-1)
    values = np.einsum("tl,hvl->thv", latent, w[b + "attn_v_b.weight"])  # the value half: (heads, vdim, kv_lora)
    scores = np.einsum("thd,shd->hts", q, keys) * lt.attn_scale
    scores[:, np.triu(np.ones((t, t), dtype=bool), 1)] = -np.inf
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("hts,shv->thv", p, values).reshape(t, heads * lt.vdim)
    return out @ w[b + "attn_output.weight"].T


def _swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g = h @ gate.T
    return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T


def _mixture(cfg: ModelConfig, w: Mapping[str, np.ndarray], b: str, h: np.ndarray) -> np.ndarray:
    lt, t, e, k = cfg.latent, len(h), cfg.experts, cfg.experts_used
    scores = h @ w[b + "ffn_gate_inp.weight"].T
    bias = [w[b + "exp_probs_b.bias"]] if lt.bias else []
    choice = expert_choice(ExpertChoice(t, e, lt.gating, lt.bias), [scores, *bias], 0)
    if lt.groups > 1:
        ids = grouped_top_k(GroupedTopK(t, e, k, lt.groups, lt.groups_used), [choice], 0)
    else:
        ids = top_k(TopK(t, e, k), [choice], 0)
    weights = route_weights(RouteWeights(t, e, k, cfg.renorm, lt.gating, lt.weights_scale), [scores, ids], 0)
    out = np.zeros_like(h)
    for row in range(t):
        for slot in range(k):
            ex = [w[b + f"ffn_{n}_exps.weight"][ids[row, slot]] for n in ("gate", "up", "down")]
            out[row] += weights[row, slot] * _swiglu(h[row : row + 1], *ex)[0]
    if cfg.shared_ff:
        out += _swiglu(h, *(w[b + f"ffn_{n}_shexp.weight"] for n in ("gate", "up", "down")))
    return out


def expanded_logits(cfg: ModelConfig, weights: Mapping[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Every row's logits of `ids` from position 0, in f64, the latent attention expanded."""
    w = {name: np.asarray(v, dtype=np.float64) for name, v in weights.items()}
    x = w["token_embd.weight"][ids]
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        x = x + _attention(cfg, w, b, _norm(cfg, x, w[b + "attn_norm.weight"]))
        h = _norm(cfg, x, w[b + "ffn_norm.weight"])
        if i < cfg.latent.dense_layers:
            x = x + _swiglu(h, *(w[b + f"ffn_{n}.weight"] for n in ("gate", "up", "down")))
        else:
            x = x + _mixture(cfg, w, b, h)
    return _norm(cfg, x, w["output_norm.weight"]) @ w["output.weight"].T
