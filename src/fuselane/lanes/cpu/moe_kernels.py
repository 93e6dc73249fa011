"""The cpu lane's kernels for a mixture of experts: routing, the per-expert products, the weighted combine.

Routing follows llama.cpp and Hugging Face: the softmax of a row's router scores over every expert, the `k`
largest kept (the lower index first on a tie: a stable sort), their probabilities renormalised over the k
where the architecture says so. The per-expert products multiply only the kept experts' matrices, each
dequantized from the file's bytes when a pair routes to it, for the rows routed to it together.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fuselane.gguf.dequant import dequantize_rows
from fuselane.graph.ops import ExpertMatmul, ExpertSort, Moe, RouteWeights, RowScale, TopK
from fuselane.lanes.cpu.latent_kernels import gate


def top_k(spec: TopK, args: list[np.ndarray], pos: int) -> np.ndarray:
    """Each row's k best experts, best first; a tie keeps the lower index first (softmax is monotone, so the
    scores rank the experts as their probabilities do)."""
    scores = args[0].reshape(spec.rows, spec.cols)
    return np.argsort(-scores, axis=-1, kind="stable")[:, : spec.k]


def route_weights(spec: RouteWeights, args: list[np.ndarray], pos: int) -> np.ndarray:
    scores, ids = args[0].reshape(spec.rows, spec.experts), args[1].reshape(spec.rows, spec.k)
    kept = np.take_along_axis(gate(spec.gating, scores), ids.astype(np.int64), axis=-1)
    if spec.renorm:
        kept = kept / kept.sum(axis=-1, keepdims=True)
    return kept * kept.dtype.type(spec.scale) if spec.scale != 1 else kept


def expert_sort(spec: ExpertSort, args: list[np.ndarray], pos: int) -> np.ndarray:
    """The (row, slot) pairs in the order of the experts they route to, stably."""
    return np.argsort(args[0].reshape(-1), kind="stable")


def combine(spec: Moe, args: list[np.ndarray], pos: int) -> np.ndarray:
    """Each row's kept experts' outputs, weighted by their routing probabilities and summed in slot order."""
    outputs = args[0].reshape(spec.rows, spec.k, spec.d)
    weights = args[1].reshape(spec.rows, spec.k, 1)
    return (outputs * weights).sum(axis=1)


def row_scale(spec: RowScale, args: list[np.ndarray], pos: int) -> np.ndarray:
    x, s = args
    return x.reshape(spec.rows, spec.cols) * s.reshape(spec.rows, 1)


MOE_KERNELS: dict[type, Callable[..., np.ndarray]] = {
    TopK: top_k,
    RouteWeights: route_weights,
    ExpertSort: expert_sort,
    Moe: combine,
    RowScale: row_scale,
}


def expert_matrix(tensor, expert: int, dtype: np.dtype) -> np.ndarray:
    """One expert's (n, kd) matrix of a 3-D expert tensor (experts, n, kd), dequantized from its own bytes."""
    experts, n, kd = tensor.shape
    rows = np.arange(expert * n, (expert + 1) * n)
    return dequantize_rows(tensor.data, tensor.format, (experts * n, kd), rows, dtype=dtype)


def expert_products(spec: ExpertMatmul, x: np.ndarray, tensor, route: list[np.ndarray], dtype) -> np.ndarray:
    """y[p] = x[p's row] @ W[ids[p]]^T for every (row, slot) pair p, expert by expert: the pairs routed to one
    expert (in `route`'s order from ExpertSort, where given) are multiplied together by its matrix, which is
    dequantized only because a pair routes to it."""
    ids = route[0].reshape(-1).astype(np.int64)
    order = route[1] if len(route) > 1 else np.argsort(ids, kind="stable")
    rows = x.reshape(-1, spec.kd)
    source = np.arange(ids.size) if spec.slotted else np.arange(ids.size) // spec.k
    out = np.empty((ids.size, spec.n), dtype=dtype)
    grouped = ids[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    for lo, hi in zip(starts, [*starts[1:], ids.size], strict=True):
        pairs = order[lo:hi]
        out[pairs] = rows[source[pairs]] @ expert_matrix(tensor, int(grouped[lo]), dtype).T
    return out
