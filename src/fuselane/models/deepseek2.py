"""Recognizer for DeepSeek's latent attention and mixtures (`deepseek2`: DeepSeek-V2, V2-Lite, V3).

A layer's attention is multi-head latent attention in its absorbed form: the cache holds one row a token, the
normed latent (`kv_lora` values) then the shared rotated key (`rope` values). Each head's query is split into
its unrotated part (`nope` values), which the key half of the latent's expansion (`attn_k_b`) absorbs into
the latent's space, and its rotated part; joined, they attend every cached row, whose latent part serves as
the values; the attended latent goes through the value half (`attn_v_b`) and the output projection. This is
the form `latent_expanded` (the cuda lane's rule) matches, and what llama.cpp runs.

The feed-forward half is dense on the first `leading_dense_block_count` layers, and past them a mixture of
routed experts with shared experts (one SwiGLU, no gate) added in: routing by a softmax, or by each score's
sigmoid with a correction bias on the choice (V3), optionally within the best groups of experts; the kept
weights renormalised where the file says so, then scaled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuselane.errors import ModelError
from fuselane.graph.ir import Dst, Form, Role, RowAt, Rows, Tensor, TensorGraph, Values
from fuselane.graph.ops import (
    Attention,
    ExpertChoice,
    ExpertMatmul,
    ExpertSort,
    Gating,
    GroupedTopK,
    HeadMatmul,
    Join,
    Matmul,
    Moe,
    Rope,
    RouteWeights,
    SetRow,
    Slice,
    TopK,
)
from fuselane.models import qwen
from fuselane.models.config import ModelConfig
from fuselane.models.latent_config import read_config
from fuselane.models.qwen import POS, VECTOR_FORMATS

__all__ = ["check_weights", "read_config", "recognize", "weight_shapes"]

BIAS = "exp_probs_b.bias"


def _attention_shapes(cfg: ModelConfig, b: str) -> dict[str, tuple[int, ...]]:
    lt, d, h = cfg.latent, cfg.n_embd, cfg.n_heads
    shapes: dict[str, tuple[int, ...]] = {b + "attn_norm.weight": (d,)}
    if lt.q_lora:
        shapes |= {
            b + "attn_q_a.weight": (lt.q_lora, d),
            b + "attn_q_a_norm.weight": (lt.q_lora,),
            b + "attn_q_b.weight": (h * lt.qk, lt.q_lora),
        }
    else:
        shapes[b + "attn_q.weight"] = (h * lt.qk, d)
    return shapes | {
        b + "attn_kv_a_mqa.weight": (lt.cache_width, d),  # the latent, then the shared rotated key
        b + "attn_kv_a_norm.weight": (lt.kv_lora,),
        b + "attn_k_b.weight": (h, lt.kv_lora, lt.nope),  # each head's key half, transposed: latent rows
        b + "attn_v_b.weight": (h, lt.vdim, lt.kv_lora),  # each head's value half: value rows
        b + "attn_output.weight": (d, h * lt.vdim),
        b + "ffn_norm.weight": (d,),
    }


def _ffn_shapes(cfg: ModelConfig, i: int, b: str) -> dict[str, tuple[int, ...]]:
    d, ff, e, eff, sff = cfg.n_embd, cfg.n_ff, cfg.experts, cfg.expert_ff, cfg.shared_ff
    if i < cfg.latent.dense_layers:
        return {b + "ffn_gate.weight": (ff, d), b + "ffn_up.weight": (ff, d), b + "ffn_down.weight": (d, ff)}
    shapes = {
        b + "ffn_gate_inp.weight": (e, d),
        b + "ffn_gate_exps.weight": (e, eff, d),
        b + "ffn_up_exps.weight": (e, eff, d),
        b + "ffn_down_exps.weight": (e, d, eff),
    }
    if sff:
        shapes |= {b + "ffn_gate_shexp.weight": (sff, d), b + "ffn_up_shexp.weight": (sff, d)}
        shapes[b + "ffn_down_shexp.weight"] = (d, sff)
    if cfg.latent.bias:
        shapes[b + BIAS] = (e,)
    return shapes


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by GGUF name, in numpy order."""
    d = cfg.n_embd
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab, d), "output_norm.weight": (d,)}
    if not cfg.tied:
        shapes["output.weight"] = (cfg.vocab, d)
    for i in range(cfg.n_layers):
        shapes |= _attention_shapes(cfg, f"blk.{i}.") | _ffn_shapes(cfg, i, f"blk.{i}.")
    return shapes


def check_weights(cfg: ModelConfig, tensors: Mapping[str, Any]) -> None:
    """Raise a ModelError naming the first tensor that is missing or disagrees with the metadata."""
    for name, shape in weight_shapes(cfg).items():
        if name not in tensors:
            raise ModelError(f"tensor '{name}' is missing")
        found = tuple(tensors[name].shape)
        if found != shape:
            raise ModelError(f"tensor '{name}' has shape {found} but the metadata implies {shape}")
        if len(shape) == 1 and tensors[name].format not in VECTOR_FORMATS:
            raise ModelError(f"tensor '{name}' is a vector stored as {tensors[name].format.name}; expected floats")
    if f"blk.{cfg.n_layers}.attn_norm.weight" in tensors:
        raise ModelError(f"the file has more layers than block_count {cfg.n_layers} says")


class Builder(qwen.Builder):
    """Emits a deepseek2 form's ops: the dense builder's embedding, norms, products and head, with latent
    attention and DeepSeek's mixture in each layer."""

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, Any], form: Form, rows: int, ctx: int, **kw) -> None:
        self.cfg, self.rows, self.ctx, self.all_logits = cfg, rows, ctx, kw["all_logits"]
        self.g = TensorGraph(form=form, rows=rows, inputs=(qwen.IDS,), params=(POS,), outputs=(qwen.LOGITS,))
        for name, shape in weight_shapes(cfg).items():
            fmt = tensors[name].format
            self.g.add(Tensor(name, shape, Values(fmt.name.lower()) if len(shape) == 1 else Rows(fmt), Role.WEIGHT))
        self.g.add(Tensor(qwen.IDS, (rows,), Values("i32"), Role.INPUT))
        self.batched = form is Form.BATCH
        self.g.add(Tensor(POS, (rows,) if self.batched else (), Values("i32"), Role.PARAM))

    def slice(self, x: str, out: str, groups: int, every: int, start: int, width: int) -> str:
        self.g.emit(Slice(groups, every, start, width), (x,), self.act(out, width, groups))
        return out

    def rope(self, x: str, out: str, heads: int) -> str:
        lt = self.cfg.latent
        spec = Rope(self.rows, heads, lt.rope, self.cfg.rope_base, half=False, batched=self.batched, yarn=lt.yarn)
        self.g.emit(spec, (x, POS), self.act(out, heads * lt.rope))
        return out

    def query(self, b: str, l_: str, h: str) -> str:
        """The query projection: plain, or through its LoRA and that's norm."""
        if not self.cfg.latent.q_lora:
            return self.matmul(h, b + "attn_q.weight", l_ + "q")
        qa = self.matmul(h, b + "attn_q_a.weight", l_ + "q_a")
        qa = self.norm(qa, b + "attn_q_a_norm.weight", l_ + "q_a_normed", self.cfg.latent.q_lora)
        return self.matmul(qa, b + "attn_q_b.weight", l_ + "q")

    def absorbed_query(self, b: str, l_: str, h: str) -> str:
        """Each head's query in the latent's space (its unrotated part through the key half), then its rotated
        part: `kv_lora + rope` values a head."""
        cfg, lt, rows = self.cfg, self.cfg.latent, self.rows
        heads = cfg.n_heads
        qr = self.query(b, l_, h)
        qn = self.slice(qr, l_ + "q_nope", rows * heads, lt.qk, 0, lt.nope)
        ql = self.act(l_ + "q_latent", heads * lt.kv_lora)
        self.g.emit(HeadMatmul(rows, heads, lt.nope, lt.kv_lora), (qn, b + "attn_k_b.weight"), ql)
        qpp = self.rope(self.slice(qr, l_ + "q_pe", rows * heads, lt.qk, lt.nope, lt.rope), l_ + "q_pe_rot", heads)
        q = self.act(l_ + "q_absorbed", heads * lt.cache_width)
        self.g.emit(Join(rows, heads, heads * lt.kv_lora, heads * lt.rope), (ql, qpp), q)
        return q

    def append_latent(self, b: str, l_: str, h: str) -> str:
        """The step's cache rows (the normed latent, then the rotated shared key) written at the position;
        returns the cache."""
        lt, rows, kw = self.cfg.latent, self.rows, self.cfg.latent.cache_width
        kv = self.matmul(h, b + "attn_kv_a_mqa.weight", l_ + "kv_a")
        latent = self.slice(kv, l_ + "latent", rows, kw, 0, lt.kv_lora)
        latent = self.norm(latent, b + "attn_kv_a_norm.weight", l_ + "latent_normed", lt.kv_lora)
        kp = self.rope(self.slice(kv, l_ + "k_pe", rows, kw, lt.kv_lora, lt.rope), l_ + "k_pe_rot", 1)
        row = self.act(l_ + "cache_row", kw)
        self.g.emit(Join(rows, 1, lt.kv_lora, lt.rope), (latent, kp), row)
        cache_rows = self.ctx * (rows if self.batched else 1)  # a batch's sequences each own a block of ctx rows
        kc = self.act(b + "latent_cache", kw, cache_rows, Role.CACHE)
        append = SetRow(rows, kw, batched=self.batched, seq_rows=self.ctx if self.batched else 0)
        self.g.emit(append, (row, POS), kc, Dst(kc, row=RowAt(POS, kw)))
        return kc

    def attention(self, b: str, l_: str, h: str) -> str:
        """Latent attention, absorbed: the query attends every cached row, their latents the values; the
        attended latent through the value half, then the output projection."""
        cfg, lt, rows = self.cfg, self.cfg.latent, self.rows
        q, kc = self.absorbed_query(b, l_, h), self.append_latent(b, l_, h)
        vc = self.slice(kc, l_ + "latent_values", self.g.tensors[kc].shape[0], lt.cache_width, 0, lt.kv_lora)
        att = Attention(rows, cfg.n_heads, 1, lt.cache_width, self.ctx, lt.attn_scale, vd=lt.kv_lora,
                        batched=self.batched)  # fmt: skip
        o = self.act(l_ + "attn_latent", cfg.n_heads * lt.kv_lora)
        self.g.emit(att, (q, kc, vc, POS), o)
        ctx = self.act(l_ + "attn", cfg.n_heads * lt.vdim)
        self.g.emit(HeadMatmul(rows, cfg.n_heads, lt.kv_lora, lt.vdim), (o, b + "attn_v_b.weight"), ctx)
        return self.matmul(ctx, b + "attn_output.weight", l_ + "attn_out")

    def route(self, b: str, l_: str, h: str) -> tuple[str, str]:
        """The kept experts' ids and weights of each row."""
        cfg, lt, rows, e, k = self.cfg, self.cfg.latent, self.rows, self.cfg.experts, self.cfg.experts_used
        scores = self.act(l_ + "router", e)
        self.g.emit(Matmul(rows, e, cfg.n_embd), (h, b + "ffn_gate_inp.weight"), scores)
        choice = scores  # a softmax ranks the experts as their scores do
        if lt.bias or lt.groups > 1 or lt.gating is not Gating.SOFTMAX:
            choice = self.act(l_ + "choice", e)
            ins = (scores, b + BIAS) if lt.bias else (scores,)
            self.g.emit(ExpertChoice(rows, e, lt.gating, lt.bias), ins, choice)
        ids = self.g.add(Tensor(l_ + "experts", (rows, k), Values("i32"), Role.ACTIVATION))
        top = GroupedTopK(rows, e, k, lt.groups, lt.groups_used) if lt.groups > 1 else TopK(rows, e, k)
        self.g.emit(top, (choice,), ids)
        weights = self.act(l_ + "route", k)
        self.g.emit(RouteWeights(rows, e, k, cfg.renorm, lt.gating, lt.weights_scale), (scores, ids), weights)
        return ids, weights

    def mixture(self, b: str, l_: str, h: str) -> str:
        """The routed experts' weighted combine, plus the shared experts' SwiGLU."""
        cfg, rows, k, d, ff = self.cfg, self.rows, self.cfg.experts_used, self.cfg.n_embd, self.cfg.expert_ff
        ids, weights = self.route(b, l_, h)
        route: tuple[str, ...] = (ids,)
        if rows > 1:  # a chunk's rows, or a batch's sequences: each expert's rows multiplied together
            order = self.g.add(Tensor(l_ + "expert_order", (rows * k,), Values("i32"), Role.ACTIVATION))
            self.g.emit(ExpertSort(rows, k, cfg.experts), (ids,), order)
            route = (ids, order)
        pairs = rows * k
        gate, up = self.act(l_ + "exp_gate", ff, pairs), self.act(l_ + "exp_up", ff, pairs)
        self.g.emit(ExpertMatmul(rows, k, ff, d), (h, b + "ffn_gate_exps.weight", *route), gate)
        self.g.emit(ExpertMatmul(rows, k, ff, d), (h, b + "ffn_up_exps.weight", *route), up)
        glu = self.glu(gate, up, l_ + "exp_glu", pairs, ff)
        down = self.act(l_ + "exp_down", d, pairs)
        self.g.emit(ExpertMatmul(rows, k, d, ff, slotted=True), (glu, b + "ffn_down_exps.weight", *route), down)
        out = l_ + ("moe" if cfg.shared_ff else "ffn_out")
        self.g.emit(Moe(rows, d, ff, cfg.experts, k), (down, weights), self.act(out, d))
        return self.shared(b, l_, h, out) if cfg.shared_ff else out

    def shared(self, b: str, l_: str, h: str, routed: str) -> str:
        """The shared experts' SwiGLU (one, `shared_experts` experts wide), added to the routed result ungated."""
        gate = self.matmul(h, b + "ffn_gate_shexp.weight", l_ + "sh_gate")
        up = self.matmul(h, b + "ffn_up_shexp.weight", l_ + "sh_up")
        glu = self.glu(gate, up, l_ + "sh_glu", self.rows, self.cfg.shared_ff)
        return self.add(routed, self.matmul(glu, b + "ffn_down_shexp.weight", l_ + "sh_down"), l_ + "ffn_out")

    def layer(self, i: int, x: str) -> str:
        cfg, b, l_ = self.cfg, f"blk.{i}.", f"l{i}."
        h = self.norm(x, b + "attn_norm.weight", l_ + "attn_in", cfg.n_embd)
        x = self.add(x, self.attention(b, l_, h), l_ + "resid_attn")
        h = self.norm(x, b + "ffn_norm.weight", l_ + "ffn_in", cfg.n_embd)
        down = self.dense_ffn(b, l_, h) if i < cfg.latent.dense_layers else self.mixture(b, l_, h)
        return self.add(x, down, l_ + "resid_ffn")


def recognize(
    cfg: ModelConfig,
    tensors: Mapping[str, Any],
    form: Form,
    *,
    rows: int = 1,
    ctx: int,
    all_logits: bool = False,
) -> TensorGraph:
    """The graph of one decode step, prefill chunk or batch step (as `qwen.recognize`), absorbed."""
    if form is Form.DECODE and rows != 1:
        raise ValueError("a decode step is one row")
    check_weights(cfg, tensors)
    return Builder(cfg, tensors, form, rows, ctx, all_logits=all_logits).build()
