"""The feed-forward half of a mixture-of-experts layer (`qwen2moe`, `qwen3moe`), as primitives.

A router product scores every expert for each row; top-k keeps the `k` best; their softmax probabilities (over
every expert, renormalised over the k kept for qwen3moe) weight the kept experts' outputs, each a SwiGLU of
the expert's own gate, up and down matrices, in the weighted combine (`Moe`). qwen2moe adds a shared expert,
a dense SwiGLU whose output is scaled by sigmoid(x . w_gate). A prefill chunk also orders its (row, slot)
pairs by expert (`ExpertSort`), so each expert's rows are multiplied together; a decode step's k pairs each
name a different expert, so it needs no order.

The expert tensors are 3-D, experts outermost, as llama.cpp's converter writes them: gate and up
(experts, expert_ff, n_embd), down (experts, n_embd, expert_ff).
"""

from __future__ import annotations

from typing import Any

from fuselane.graph.ir import Role, Tensor, Values
from fuselane.graph.ops import (
    Elementwise,
    ElementwiseOp,
    ExpertMatmul,
    ExpertSort,
    Matmul,
    Moe,
    RouteWeights,
    RowScale,
    TopK,
    Unary,
    UnaryOp,
)
from fuselane.models.config import ModelConfig
from fuselane.parallel.graph import local_route

SHARED_GATE = "ffn_gate_inp_shexp.weight"


def weight_shapes(cfg: ModelConfig, b: str) -> dict[str, tuple[int, ...]]:
    """A mixture layer's feed-forward tensors, by GGUF name, in numpy order."""
    d, e, ff = cfg.n_embd, cfg.experts, cfg.expert_ff
    held = cfg.shard.experts.count if cfg.shard else e  # a rank holds its experts, and the whole router
    shapes = {
        b + "ffn_gate_inp.weight": (e, d),  # the router: one row of scores an expert
        b + "ffn_gate_exps.weight": (held, ff, d),
        b + "ffn_up_exps.weight": (held, ff, d),
        b + "ffn_down_exps.weight": (held, d, ff),
    }
    if cfg.shared_ff:
        sff = cfg.shared_ff
        shapes |= {
            b + "ffn_gate_shexp.weight": (sff, d),
            b + "ffn_up_shexp.weight": (sff, d),
            b + "ffn_down_shexp.weight": (d, sff),
            b + SHARED_GATE: (d,),  # the shared expert's gate: one score a row (llama.cpp reads it as a vector)
        }
    return shapes


def same_vector(name: str, found: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether the shared expert's gate is stored as the one-row matrix Hugging Face holds, (1, n_embd),
    rather than the vector llama.cpp reads: the same values."""
    return name.endswith(SHARED_GATE) and found == (1, *want)


def graph_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A weight's shape in the graph: the file's, but the shared expert's gate (a vector in the file, or one
    row) is the one-row matrix its product multiplies by, checkpoint rows like every product's weight."""
    return (1, *shape) if name.endswith(SHARED_GATE) else shape


def mixture(bd: Any, b: str, l_: str, h: str) -> str:
    """Emit the mixture of layer prefix `b` over the normed rows `h` into the builder `bd` (a `qwen.Builder`);
    returns the name of its result, one `n_embd` row a row."""
    cfg: ModelConfig = bd.cfg
    rows, k, e, d, ff = bd.rows, cfg.experts_used, cfg.experts, cfg.n_embd, cfg.expert_ff
    scores = bd.act(l_ + "router", e)
    bd.g.emit(Matmul(rows, e, d), (h, b + "ffn_gate_inp.weight"), scores)
    ids = bd.g.add(Tensor(l_ + "experts", (rows, k), Values("i32"), Role.ACTIVATION))
    bd.g.emit(TopK(rows, e, k), (scores,), ids)
    weights = bd.act(l_ + "route", k)
    bd.g.emit(RouteWeights(rows, e, k, cfg.renorm), (scores, ids), weights)
    if cfg.shard:  # expert parallel: the rank multiplies only by its own experts
        ids, weights = local_route(bd, l_, ids, weights)
    route: tuple[str, ...] = (ids,)
    if rows > 1:  # a chunk's rows, or a batch's sequences: each expert's rows multiplied together
        order = bd.g.add(Tensor(l_ + "expert_order", (rows * k,), Values("i32"), Role.ACTIVATION))
        bd.g.emit(ExpertSort(rows, k, e), (ids,), order)
        route = (ids, order)
    pairs = rows * k
    gate = bd.act(l_ + "exp_gate", ff, pairs)
    bd.g.emit(ExpertMatmul(rows, k, ff, d), (h, b + "ffn_gate_exps.weight", *route), gate)
    up = bd.act(l_ + "exp_up", ff, pairs)
    bd.g.emit(ExpertMatmul(rows, k, ff, d), (h, b + "ffn_up_exps.weight", *route), up)
    glu = bd.glu(gate, up, l_ + "exp_glu", pairs, ff)
    down = bd.act(l_ + "exp_down", d, pairs)
    bd.g.emit(ExpertMatmul(rows, k, d, ff, slotted=True), (glu, b + "ffn_down_exps.weight", *route), down)
    out = l_ + ("moe" if cfg.shared_ff else "ffn_out")
    bd.g.emit(Moe(rows, d, ff, e, k), (down, weights), bd.act(out, d))
    return _shared_expert(bd, b, l_, h, out) if cfg.shared_ff else out


def _shared_expert(bd: Any, b: str, l_: str, h: str, routed: str) -> str:
    """The shared expert's SwiGLU, scaled by sigmoid(h . w_gate), added to the routed experts' result."""
    cfg: ModelConfig = bd.cfg
    rows, d, sff = bd.rows, cfg.n_embd, cfg.shared_ff
    gate = bd.matmul(h, b + "ffn_gate_shexp.weight", l_ + "sh_gate")
    up = bd.matmul(h, b + "ffn_up_shexp.weight", l_ + "sh_up")
    glu = bd.glu(gate, up, l_ + "sh_glu", rows, sff)
    shared = bd.matmul(glu, b + "ffn_down_shexp.weight", l_ + "sh_down")
    score = bd.act(l_ + "sh_score", 1)
    bd.g.emit(Matmul(rows, 1, d), (h, b + SHARED_GATE), score)
    scale = bd.act(l_ + "sh_scale", 1)
    bd.g.emit(Unary(UnaryOp.SIGMOID, rows, 1), (score,), scale)
    scaled = bd.act(l_ + "sh_scaled", d)
    bd.g.emit(RowScale(rows, d), (shared, scale), scaled)
    bd.g.emit(Elementwise(ElementwiseOp.ADD, rows, d), (routed, scaled), bd.act(l_ + "ffn_out", d))
    return l_ + "ffn_out"
