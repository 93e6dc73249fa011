"""The cpu lane's kernels for DeepSeek's layers: per-head products, the router's choice scores, grouped top-k,
and YaRN's rotary frequencies.

Grouped routing follows DeepSeek-V3 (and llama.cpp, for every deepseek2 file): a group scores the sum of its
two best choice scores, each row keeps its best groups, and its top-k is taken over their experts alone.
Ties keep the lower index first (a stable sort), as the mixture's plain top-k does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fuselane.graph.ops import ExpertChoice, Gating, GroupedTopK, HeadMatmul, Yarn

GROUP_BEST = 2  # a group's score: the sum of its two best experts' choice scores (V3)


def head_matmul(spec: HeadMatmul, args: list[np.ndarray], pos: int) -> np.ndarray:
    """Each head of each row times its own (b, a) matrix: out[m, h] = W[h] @ x[m, h]."""
    x, w = args
    heads = x.reshape(spec.m, spec.heads, spec.a)
    return np.einsum("mha,hba->mhb", heads, w.reshape(spec.heads, spec.b, spec.a)).reshape(spec.m, -1)


def gate(gating: Gating, scores: np.ndarray) -> np.ndarray:
    """Routing probabilities of each row's scores: the softmax over the row, or each score's sigmoid."""
    if gating is Gating.SIGMOID:
        with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0: the right 0
            return 1 / (1 + np.exp(-scores))
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return probs / probs.sum(axis=-1, keepdims=True)


def expert_choice(spec: ExpertChoice, args: list[np.ndarray], pos: int) -> np.ndarray:
    probs = gate(spec.gating, args[0].reshape(spec.rows, spec.experts))
    return probs + args[1].reshape(1, spec.experts) if spec.bias else probs


def grouped_top_k(spec: GroupedTopK, args: list[np.ndarray], pos: int) -> np.ndarray:
    """Each row's k best experts within its `used` best groups, best first."""
    choice = args[0].reshape(spec.rows, spec.experts)
    runs = choice.reshape(spec.rows, spec.groups, -1)
    group_scores = -np.sort(-runs, axis=-1)[..., :GROUP_BEST].sum(axis=-1)
    kept_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, : spec.used]
    mask = np.zeros((spec.rows, spec.groups), dtype=bool)
    np.put_along_axis(mask, kept_groups, True, axis=-1)
    masked = np.where(np.repeat(mask, runs.shape[-1], axis=-1), choice, -np.inf)
    return np.argsort(-masked, axis=-1, kind="stable")[:, : spec.k]


def inv_freq(hd: int, base: float, yarn: Yarn | None) -> np.ndarray:
    """The hd/2 rotary frequencies in f64, stretched by YaRN where given: a frequency turning more than
    `beta_fast` times over the original context keeps its value, one turning fewer than `beta_slow` times is
    divided by the factor, and those between take a linear mix of both."""
    extrapolated = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    if yarn is None:
        return extrapolated
    low, width = yarn.ramp(hd, base)
    ramp = np.clip((np.arange(hd // 2) - low) / width, 0.0, 1.0)
    return extrapolated / yarn.factor * ramp + extrapolated * (1 - ramp)


LATENT_KERNELS: dict[type, Callable[..., np.ndarray]] = {
    HeadMatmul: head_matmul,
    ExpertChoice: expert_choice,
    GroupedTopK: grouped_top_k,
}
