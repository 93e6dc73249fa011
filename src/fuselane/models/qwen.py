"""Recognizer for Qwen models: `qwen2` (q/k/v biases) and `qwen3` (per-head q/k RMS norm), dense, and their
mixtures of experts `qwen2moe` and `qwen3moe`, whose feed-forward half is `models.moe`'s.

It turns a config and the checkpoint's tensor table into a graph of primitive ops for one form: a decode step
(one row at position `pos`) or a prefill chunk (`rows` rows at positions pos .. pos + rows - 1). Every weight
is checked against the shape the metadata implies before any op is built, so a bad file fails by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fuselane.errors import ModelError
from fuselane.gguf.formats import Format
from fuselane.graph.ir import Dst, Form, Role, RowAt, Rows, Tensor, TensorGraph, Values
from fuselane.graph.ops import (
    Attention,
    Elementwise,
    ElementwiseOp,
    Matmul,
    RmsNorm,
    Rope,
    RowsGather,
    SetRow,
    TakeRows,
    Unary,
    UnaryOp,
)
from fuselane.models import moe
from fuselane.models.config import ModelConfig
from fuselane.parallel import graph as parallel_graph

POS = "pos"  # the position parameter: the first row's place in the sequence
IDS = "ids"  # the step's token ids
LOGITS = "logits"
VECTOR_FORMATS = (Format.F32, Format.F16, Format.BF16)


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, by GGUF name, in numpy order (rows, row length)."""
    d, q, kv, ff, hd = cfg.n_embd, cfg.q_width, cfg.kv_width, cfg.n_ff, cfg.head_dim
    vocab = cfg.shard.vocab.count if cfg.shard else cfg.vocab  # a rank holds its vocabulary rows
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    if not cfg.tied:
        shapes["output.weight"] = (vocab, d)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (d,),
            b + "attn_q.weight": (q, d),
            b + "attn_k.weight": (kv, d),
            b + "attn_v.weight": (kv, d),
            b + "attn_output.weight": (d, q),
            b + "ffn_norm.weight": (d,),
        }
        if cfg.moe:
            shapes |= moe.weight_shapes(cfg, b)
        else:
            shapes |= {b + "ffn_gate.weight": (ff, d), b + "ffn_up.weight": (ff, d), b + "ffn_down.weight": (d, ff)}
        if cfg.qkv_bias:
            shapes |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
    return shapes


def check_weights(cfg: ModelConfig, tensors: Mapping[str, Any]) -> None:
    """Raise a ModelError naming the first tensor that is missing or disagrees with the metadata."""
    family = cfg.arch.removesuffix("moe")
    if family == "qwen2" and not cfg.qkv_bias:
        raise ModelError(f"tensor 'blk.0.attn_q.bias' is missing ({cfg.arch} adds a bias to q, k and v)")
    if family == "qwen3" and not cfg.qk_norm:
        raise ModelError(f"tensor 'blk.0.attn_q_norm.weight' is missing ({cfg.arch} norms q and k per head)")
    for name, shape in weight_shapes(cfg).items():
        if name not in tensors:
            raise ModelError(f"tensor '{name}' is missing")
        found = tuple(tensors[name].shape)
        if found != shape and not moe.same_vector(name, found, shape):
            raise ModelError(f"tensor '{name}' has shape {found} but the metadata implies {shape}")
        if len(shape) == 1 and tensors[name].format not in VECTOR_FORMATS:
            raise ModelError(f"tensor '{name}' is a vector stored as {tensors[name].format.name}; expected floats")
    if f"blk.{cfg.n_layers}.attn_norm.weight" in tensors:
        raise ModelError(f"the file has more layers than block_count {cfg.n_layers} says")


class Builder:
    """Emits one form's ops into a graph; names activations `l{layer}.{what}`."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Mapping[str, Any],
        form: Form,
        rows: int,
        ctx: int,
        *,
        all_logits: bool,
    ) -> None:
        self.cfg, self.rows, self.ctx, self.all_logits = cfg, rows, ctx, all_logits
        self.g = TensorGraph(form=form, rows=rows, inputs=(IDS,), params=(POS,), outputs=(LOGITS,))
        for name, shape in weight_shapes(cfg).items():
            fmt = tensors[name].format
            shape = moe.graph_shape(name, shape)  # the shared expert's gate is a one-row product's weight
            storage = Values(fmt.name.lower()) if len(shape) == 1 else Rows(fmt)
            self.g.add(Tensor(name, shape, storage, Role.WEIGHT))
        self.g.add(Tensor(IDS, (rows,), Values("i32"), Role.INPUT))
        self.batched = form is Form.BATCH
        self.g.add(Tensor(POS, (rows,) if self.batched else (), Values("i32"), Role.PARAM))

    def act(self, name: str, cols: int, rows: int | None = None, role: Role = Role.ACTIVATION) -> str:
        return self.g.add(Tensor(name, (rows or self.rows, cols), Values("f32"), role))

    def norm(self, x: str, w: str, out: str, cols: int, units: int | None = None) -> str:
        """RMS norm of `units` rows of `cols` values, then the weight multiply (the NormWeight pattern)."""
        units = units or self.rows
        width = self.g.tensors[x].shape[-1]
        normed = self.act(out + ".normed", width)
        self.g.emit(RmsNorm(units, cols, self.cfg.rms_eps), (x,), normed)
        self.g.emit(Elementwise(ElementwiseOp.MUL, units, cols, row=True), (normed, w), self.act(out, width))
        return out

    def matmul(self, x: str, w: str, out: str, bias: str | None = None) -> str:
        n, k = self.g.tensors[w].shape
        y = self.act(out + ".raw" if bias else out, n)
        self.g.emit(Matmul(self.rows, n, k), (x, w), y)
        if bias:
            self.g.emit(Elementwise(ElementwiseOp.ADD, self.rows, n, row=True), (y, bias), self.act(out, n))
        return out

    def add(self, a: str, b: str, out: str) -> str:
        cols = self.g.tensors[a].shape[-1]
        self.g.emit(Elementwise(ElementwiseOp.ADD, self.rows, cols), (a, b), self.act(out, cols))
        return out

    def layer(self, i: int, x: str) -> str:
        cfg, rows, b, l_ = self.cfg, self.rows, f"blk.{i}.", f"l{i}."
        h = self.norm(x, b + "attn_norm.weight", l_ + "attn_in", cfg.n_embd)
        bias = cfg.qkv_bias
        q = self.matmul(h, b + "attn_q.weight", l_ + "q", b + "attn_q.bias" if bias else None)
        k = self.matmul(h, b + "attn_k.weight", l_ + "k", b + "attn_k.bias" if bias else None)
        v = self.matmul(h, b + "attn_v.weight", l_ + "v", b + "attn_v.bias" if bias else None)
        if cfg.qk_norm:
            q = self.norm(q, b + "attn_q_norm.weight", l_ + "q_normed", cfg.head_dim, rows * cfg.n_heads)
            k = self.norm(k, b + "attn_k_norm.weight", l_ + "k_normed", cfg.head_dim, rows * cfg.n_kv_heads)
        qr, kr = self.act(l_ + "q_rot", cfg.q_width), self.act(l_ + "k_rot", cfg.kv_width)
        seqs = self.batched
        turn = dict(batched=seqs, yarn=cfg.yarn)
        self.g.emit(Rope(rows, cfg.n_heads, cfg.head_dim, cfg.rope_base, **turn), (q, POS), qr)
        self.g.emit(Rope(rows, cfg.n_kv_heads, cfg.head_dim, cfg.rope_base, **turn), (k, POS), kr)
        cache_rows = self.ctx * (rows if seqs else 1)  # a batch's sequences each own a block of ctx rows
        kc = self.act(b + "k_cache", cfg.kv_width, cache_rows, Role.CACHE)
        vc = self.act(b + "v_cache", cfg.kv_width, cache_rows, Role.CACHE)
        append = SetRow(rows, cfg.kv_width, batched=seqs, seq_rows=self.ctx if seqs else 0)
        self.g.emit(append, (kr, POS), kc, Dst(kc, row=RowAt(POS, cfg.kv_width)))
        self.g.emit(append, (v, POS), vc, Dst(vc, row=RowAt(POS, cfg.kv_width)))
        scale = cfg.score_scale / math.sqrt(cfg.head_dim)
        att = Attention(rows, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.ctx, scale, batched=seqs)
        o = self.act(l_ + "attn", cfg.q_width)
        self.g.emit(att, (qr, kc, vc, POS), o)
        a = self.reduced(self.matmul(o, b + "attn_output.weight", l_ + "attn_out"))
        x = self.add(x, a, l_ + "resid_attn")
        h = self.norm(x, b + "ffn_norm.weight", l_ + "ffn_in", cfg.n_embd)
        down = self.reduced(moe.mixture(self, b, l_, h) if cfg.moe else self.dense_ffn(b, l_, h))
        return self.add(x, down, l_ + "resid_ffn")

    def reduced(self, partial: str) -> str:
        """A rank's partial sum made whole over the ranks (the unsplit model's result is whole already)."""
        return parallel_graph.reduce(self, partial) if self.cfg.shard else partial

    def glu(self, gate: str, up: str, out: str, rows: int, cols: int) -> str:
        """silu(gate) * up over `rows` rows of `cols` values."""
        act = self.act(out + "_act", cols, rows)
        self.g.emit(Unary(UnaryOp.SILU, rows, cols), (gate,), act)
        self.g.emit(Elementwise(ElementwiseOp.MUL, rows, cols), (act, up), self.act(out, cols, rows))
        return out

    def dense_ffn(self, b: str, l_: str, h: str) -> str:
        cfg, rows = self.cfg, self.rows
        gate = self.matmul(h, b + "ffn_gate.weight", l_ + "gate")
        up = self.matmul(h, b + "ffn_up.weight", l_ + "up")
        act = self.act(l_ + "gate_act", cfg.n_ff)
        self.g.emit(Unary(UnaryOp.SILU, rows, cfg.n_ff), (gate,), act)
        glu = self.act(l_ + "glu", cfg.n_ff)
        self.g.emit(Elementwise(ElementwiseOp.MUL, rows, cfg.n_ff), (act, up), glu)
        return self.matmul(glu, b + "ffn_down.weight", l_ + "ffn_out")

    def build(self) -> TensorGraph:
        cfg = self.cfg
        x = self.act("embd", cfg.n_embd)
        if cfg.shard:
            parallel_graph.embed(self, "token_embd.weight", IDS, x)
        else:
            self.g.emit(RowsGather(self.rows, cfg.n_embd), ("token_embd.weight", IDS), x)
        for i in range(cfg.n_layers):
            x = self.layer(i, x)
        if not self.all_logits and self.rows > 1 and not self.batched:
            last = self.act("last", cfg.n_embd, 1)
            self.g.emit(TakeRows(self.rows, cfg.n_embd, 1), (x,), last)
            x, self.rows = last, 1
        h = self.norm(x, "output_norm.weight", "out_in", cfg.n_embd)
        head = "token_embd.weight" if cfg.tied else "output.weight"
        self.g.add(Tensor(LOGITS, (self.rows, cfg.vocab), Values("f32"), Role.OUTPUT))
        if cfg.shard:
            parallel_graph.head(self, h, head, LOGITS)
        else:
            self.g.emit(Matmul(self.rows, cfg.vocab, cfg.n_embd), (h, head), LOGITS)
        return self.g


def recognize(
    cfg: ModelConfig,
    tensors: Mapping[str, Any],
    form: Form,
    *,
    rows: int = 1,
    ctx: int,
    all_logits: bool = False,
) -> TensorGraph:
    """The graph of one decode step (`rows` = 1), one prefill chunk of `rows` rows, or one step of a batch of
    `rows` sequences (each its own `ctx`-row block of the caches, each at its own position), over a `ctx`-row
    cache.

    A prefill chunk computes logits for its last row only, unless `all_logits`.
    """
    if form is Form.DECODE and rows != 1:
        raise ValueError("a decode step is one row")
    check_weights(cfg, tensors)
    return Builder(cfg, tensors, form, rows, ctx, all_logits=all_logits).build()
