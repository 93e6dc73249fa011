"""Recognizer for Qwen3-Next (`qwen3next`): a hybrid of gated delta-rule (linear-attention) layers and gated
full-attention layers, each followed by the qwen2moe-style mixture with a sigmoid-gated shared expert.

A linear layer projects its normed input to the queries, keys and values of a row (`attn_qkv`), the output
gate z (`attn_gate`) and each value head's beta and alpha (`ssm_ba`, per key head: its value heads' betas,
then their alphas); runs the queries, keys and values through a depth-wise causal convolution (`ssm_conv1d`,
its state the sequence's last taps - 1 inputs) and a SiLU; L2-norms each query and key head; gates the
delta rule with beta = sigmoid(b) and the decay g = ssm_a * softplus(a + ssm_dt), where the file's `ssm_a`
is -exp(A_log); runs the rule over its state; norms each value head of the result by RMS with `ssm_norm`,
times silu(z); and projects back (`ssm_out`). A full-attention layer's query product holds, per head, the
query and then its output gate; q and k are RMS-normed per head, rotated on their first `rope_dim` values,
attended as in qwen3, and the attention's output is multiplied by sigmoid(gate) before `attn_output`.

Norm weights are used as the file holds them: llama.cpp's converter adds the +1 of the Hugging Face model to
every one but the gated `ssm_norm`. A batch form (several sequences) is refused: the recurrent state is one
sequence's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fuselane.errors import ModelError
from fuselane.graph.ir import Dst, Form, Role, RowAt, Rows, Tensor, TensorGraph, Values
from fuselane.graph.ops import (
    Attention,
    CausalConv,
    ConvShift,
    DeltaState,
    Elementwise,
    ElementwiseOp,
    GatedDelta,
    L2Norm,
    RmsNorm,
    Rope,
    SetRow,
    Slice,
    Unary,
    UnaryOp,
)
from fuselane.models import config, moe
from fuselane.models.config import ModelConfig
from fuselane.models.qwen import IDS, POS, VECTOR_FORMATS, Builder
from fuselane.models.qwen3next_config import read_hybrid

# Tensors the graph reads as plain values, not as a product's checkpoint rows.
_VALUE_TENSORS = ("ssm_conv1d.weight",)


def read_config(meta: Mapping[str, Any], tensors: Mapping[str, Any], arch: str) -> ModelConfig:
    """The shared config reading with the hybrid's own fields (its delta-rule layers, the partial rotary)."""
    return config.read_config(meta, tensors, arch, extra=read_hybrid)


def _full_shapes(cfg: ModelConfig, b: str) -> dict[str, tuple[int, ...]]:
    d, q, kv, hd = cfg.n_embd, cfg.q_width, cfg.kv_width, cfg.head_dim
    return {
        b + "attn_q.weight": (2 * q, d),  # each head's query, then its output gate
        b + "attn_k.weight": (kv, d),
        b + "attn_v.weight": (kv, d),
        b + "attn_q_norm.weight": (hd,),
        b + "attn_k_norm.weight": (hd,),
        b + "attn_output.weight": (d, q),
    }


def _linear_shapes(cfg: ModelConfig, b: str) -> dict[str, tuple[int, ...]]:
    la, d = cfg.linear, cfg.n_embd
    assert la is not None
    return {
        b + "attn_qkv.weight": (la.conv_width, d),  # every query head, every key head, every value head
        b + "attn_gate.weight": (la.value_width, d),  # z, one row of each value head
        b + "ssm_conv1d.weight": (la.conv_width, la.conv),  # per channel, its taps oldest first
        b + "ssm_a": (la.v_heads,),  # -exp(A_log)
        b + "ssm_dt.bias": (la.v_heads,),
        b + "ssm_ba.weight": (2 * la.v_heads, d),  # per key head: its value heads' b, then their a
        b + "ssm_norm.weight": (la.v_dim,),  # the gated norm's weight (no +1 added)
        b + "ssm_out.weight": (d, la.value_width),
    }


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, by GGUF name, in numpy order."""
    d, la = cfg.n_embd, cfg.linear
    assert la is not None
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab, d), "output_norm.weight": (d,)}
    if not cfg.tied:
        shapes["output.weight"] = (cfg.vocab, d)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (d,), b + "post_attention_norm.weight": (d,)}
        shapes |= _linear_shapes(cfg, b) if la.layers[i] else _full_shapes(cfg, b)
        shapes |= moe.weight_shapes(cfg, b)
    return shapes


def check_weights(cfg: ModelConfig, tensors: Mapping[str, Any]) -> None:
    """Raise a ModelError naming the first tensor that is missing or disagrees with the metadata."""
    for name, shape in weight_shapes(cfg).items():
        if name not in tensors:
            raise ModelError(f"tensor '{name}' is missing")
        found = tuple(tensors[name].shape)
        if found != shape and not moe.same_vector(name, found, shape):
            raise ModelError(f"tensor '{name}' has shape {found} but the metadata implies {shape}")
        plain = len(shape) == 1 or name.endswith(_VALUE_TENSORS)
        if plain and tensors[name].format not in VECTOR_FORMATS:
            raise ModelError(f"tensor '{name}' is stored as {tensors[name].format.name}; expected floats")
    if f"blk.{cfg.n_layers}.attn_norm.weight" in tensors:
        raise ModelError(f"the file has more layers than block_count {cfg.n_layers} says")


class _HybridBuilder(Builder):
    """Emits one form's ops of a Qwen3-Next model; names activations `l{layer}.{what}`."""

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, Any], form: Form, rows: int, ctx: int, **kw) -> None:
        self.cfg, self.rows, self.ctx, self.all_logits = cfg, rows, ctx, kw["all_logits"]
        self.g = TensorGraph(form=form, rows=rows, inputs=(IDS,), params=(POS,), outputs=("logits",))
        for name, shape in weight_shapes(cfg).items():
            fmt = tensors[name].format
            shape = moe.graph_shape(name, shape)
            plain = len(shape) == 1 or name.endswith(_VALUE_TENSORS)
            storage = Values(fmt.name.lower()) if plain else Rows(fmt)
            self.g.add(Tensor(name, shape, storage, Role.WEIGHT))
        self.g.add(Tensor(IDS, (rows,), Values("i32"), Role.INPUT))
        self.batched = False
        self.g.add(Tensor(POS, (), Values("i32"), Role.PARAM))

    def emit_to(self, spec: Any, ins: tuple[str, ...], name: str, cols: int, rows: int | None = None) -> str:
        """Emit `spec` writing a new activation `name` of `rows` x `cols`."""
        self.g.emit(spec, ins, self.act(name, cols, rows))
        return name

    def slice(self, x: str, out: str, groups: int, every: int, start: int, width: int) -> str:
        """`width` values at `start` of each of `groups` units of `every` values, as rows of this step."""
        return self.emit_to(Slice(groups, every, start, width), (x,), out, groups * width // self.rows)

    def layer(self, i: int, x: str) -> str:
        cfg, b, l_ = self.cfg, f"blk.{i}.", f"l{i}."
        assert cfg.linear is not None
        h = self.norm(x, b + "attn_norm.weight", l_ + "attn_in", cfg.n_embd)
        mixer = self.linear_attention if cfg.linear.layers[i] else self.gated_attention
        x = self.add(x, mixer(b, l_, h), l_ + "resid_attn")
        h = self.norm(x, b + "post_attention_norm.weight", l_ + "ffn_in", cfg.n_embd)
        return self.add(x, moe.mixture(self, b, l_, h), l_ + "resid_ffn")

    # --- full attention ------------------------------------------------------------------------------------

    def gated_attention(self, b: str, l_: str, h: str) -> str:
        cfg, rows, hd = self.cfg, self.rows, self.cfg.head_dim
        heads, kv = cfg.n_heads, cfg.n_kv_heads
        qg = self.matmul(h, b + "attn_q.weight", l_ + "q_gate")
        q = self.slice(qg, l_ + "q", rows * heads, 2 * hd, 0, hd)
        gate = self.slice(qg, l_ + "gate", rows * heads, 2 * hd, hd, hd)
        k = self.matmul(h, b + "attn_k.weight", l_ + "k")
        v = self.matmul(h, b + "attn_v.weight", l_ + "v")
        q = self.norm(q, b + "attn_q_norm.weight", l_ + "q_normed", hd, rows * heads)
        k = self.norm(k, b + "attn_k_norm.weight", l_ + "k_normed", hd, rows * kv)
        rot = cfg.rope_dim
        turn = dict(rot=rot, yarn=cfg.yarn)
        qr = self.emit_to(Rope(rows, heads, hd, cfg.rope_base, **turn), (q, POS), l_ + "q_rot", cfg.q_width)
        kr = self.emit_to(Rope(rows, kv, hd, cfg.rope_base, **turn), (k, POS), l_ + "k_rot", cfg.kv_width)
        kc = self.act(b + "k_cache", cfg.kv_width, self.ctx, Role.CACHE)
        vc = self.act(b + "v_cache", cfg.kv_width, self.ctx, Role.CACHE)
        self.g.emit(SetRow(rows, cfg.kv_width), (kr, POS), kc, Dst(kc, row=RowAt(POS, cfg.kv_width)))
        self.g.emit(SetRow(rows, cfg.kv_width), (v, POS), vc, Dst(vc, row=RowAt(POS, cfg.kv_width)))
        att = Attention(rows, heads, kv, hd, self.ctx, cfg.score_scale / math.sqrt(hd))
        o = self.emit_to(att, (qr, kc, vc, POS), l_ + "attn", cfg.q_width)
        sig = self.emit_to(Unary(UnaryOp.SIGMOID, rows, cfg.q_width), (gate,), l_ + "gate_sig", cfg.q_width)
        gated = self.emit_to(
            Elementwise(ElementwiseOp.MUL, rows, cfg.q_width), (o, sig), l_ + "attn_gated", cfg.q_width
        )
        return self.matmul(gated, b + "attn_output.weight", l_ + "attn_out")

    # --- the gated delta rule ------------------------------------------------------------------------------

    def linear_attention(self, b: str, l_: str, h: str) -> str:
        cfg, rows, la = self.cfg, self.rows, self.cfg.linear
        assert la is not None
        chan, kw = la.conv_width, la.key_width
        qkv = self.matmul(h, b + "attn_qkv.weight", l_ + "qkv")
        z = self.matmul(h, b + "attn_gate.weight", l_ + "z")
        ba = self.matmul(h, b + "ssm_ba.weight", l_ + "ba")
        conv_state = self.act(l_ + "conv_state", chan, la.conv - 1, Role.STATE)
        raw = self.emit_to(
            CausalConv(rows, chan, la.conv), (qkv, conv_state, b + "ssm_conv1d.weight"), l_ + "conv", chan
        )
        self.g.emit(ConvShift(rows, chan, la.conv - 1), (qkv, conv_state), conv_state, Dst(conv_state))
        mixed = self.emit_to(Unary(UnaryOp.SILU, rows, chan), (raw,), l_ + "conv_act", chan)
        q = self.slice(mixed, l_ + "lq", rows, chan, 0, kw)
        k = self.slice(mixed, l_ + "lk", rows, chan, kw, kw)
        v = self.slice(mixed, l_ + "lv", rows, chan, 2 * kw, la.value_width)
        units = rows * la.k_heads
        qn = self.emit_to(L2Norm(units, la.k_dim, cfg.rms_eps), (q,), l_ + "lq_normed", kw)
        kn = self.emit_to(L2Norm(units, la.k_dim, cfg.rms_eps), (k,), l_ + "lk_normed", kw)
        beta, decay = self.gates(b, l_, ba)
        rule = GatedDelta(rows, la.v_heads, la.k_dim, la.v_dim, k_heads=la.k_heads, scale=la.k_dim**-0.5)
        state = self.g.add(Tensor(l_ + "delta_state", (la.v_heads, la.k_dim, la.v_dim), Values("f32"), Role.STATE))
        o = self.emit_to(rule, (qn, kn, v, decay, beta, state), l_ + "delta", la.value_width)
        self.g.emit(DeltaState(rule), (kn, v, decay, beta, state), state, Dst(state))
        return self.gated_norm(b, l_, o, z)

    def gates(self, b: str, l_: str, ba: str) -> tuple[str, str]:
        """beta = sigmoid(b) and the decay g = ssm_a * softplus(a + ssm_dt), one a value head of each row."""
        rows, la = self.rows, self.cfg.linear
        assert la is not None
        per = la.v_heads // la.k_heads  # value heads a key head
        nv = la.v_heads
        bs = self.slice(ba, l_ + "b", rows * la.k_heads, 2 * per, 0, per)
        a = self.slice(ba, l_ + "a", rows * la.k_heads, 2 * per, per, per)
        beta = self.emit_to(Unary(UnaryOp.SIGMOID, rows, nv), (bs,), l_ + "beta", nv)
        biased = self.emit_to(
            Elementwise(ElementwiseOp.ADD, rows, nv, row=True), (a, b + "ssm_dt.bias"), l_ + "a_dt", nv
        )
        soft = self.emit_to(Unary(UnaryOp.SOFTPLUS, rows, nv), (biased,), l_ + "a_soft", nv)
        decay = self.emit_to(Elementwise(ElementwiseOp.MUL, rows, nv, row=True), (soft, b + "ssm_a"), l_ + "decay", nv)
        return beta, decay

    def gated_norm(self, b: str, l_: str, o: str, z: str) -> str:
        """RMS norm of each value head of the rule's output, times `ssm_norm`, times silu(z); projected back."""
        rows, la = self.rows, self.cfg.linear
        assert la is not None
        width = la.value_width
        normed = self.emit_to(RmsNorm(rows * la.v_heads, la.v_dim, self.cfg.rms_eps), (o,), l_ + "o_normed", width)
        spec = Elementwise(ElementwiseOp.MUL, rows * la.v_heads, la.v_dim, row=True)
        weighted = self.emit_to(spec, (normed, b + "ssm_norm.weight"), l_ + "o_weighted", width)
        gate = self.emit_to(Unary(UnaryOp.SILU, rows, width), (z,), l_ + "z_act", width)
        gated = self.emit_to(Elementwise(ElementwiseOp.MUL, rows, width), (weighted, gate), l_ + "o_gated", width)
        return self.matmul(gated, b + "ssm_out.weight", l_ + "linear_out")


def recognize(
    cfg: ModelConfig,
    tensors: Mapping[str, Any],
    form: Form,
    *,
    rows: int = 1,
    ctx: int,
    all_logits: bool = False,
) -> TensorGraph:
    """The graph of one decode step (`rows` = 1) or one prefill chunk of `rows` rows over a `ctx`-row cache and
    the layers' recurrent states; a prefill chunk computes logits for its last row only, unless `all_logits`."""
    if form is Form.DECODE and rows != 1:
        raise ValueError("a decode step is one row")
    if form is Form.BATCH:
        raise ModelError("qwen3next runs one sequence at a time: its recurrent state is one sequence's")
    check_weights(cfg, tensors)
    return _HybridBuilder(cfg, tensors, form, rows, ctx, all_logits=all_logits).build()
