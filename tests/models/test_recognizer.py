"""The Qwen recognizer: configs read from metadata, the graphs it builds, and the errors it gives.

Graphs are built from metadata and tensor tables alone (stand-ins carrying a shape and a format), so shapes
can be drawn freely with hypothesis without writing files; one test runs a written tiny file on the cpu lane
to check that a prefill chunk's logits are the decode steps' logits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuselane.errors import ModelError
from fuselane.gguf.formats import Format
from fuselane.gguf.synth import SHAPES, Shape, model_metadata, tensor_formats, tensor_shapes, write_synthetic
from fuselane.graph.facts import producers, readers, reads, writes
from fuselane.graph.ir import Form, Role, RowAt, TensorGraph
from fuselane.graph.ops import Attention, Elementwise, RmsNorm, Rope, SetRow, TakeRows, Unary
from fuselane.models import config_of, recognizer
from fuselane.models.qwen import IDS, LOGITS, POS, recognize

AVAILABLE = (Role.WEIGHT, Role.INPUT, Role.PARAM, Role.CACHE)  # what exists before a step's first op


@dataclasses.dataclass(frozen=True)
class Stub:
    """What the recognizer needs of a tensor: its numpy-order shape and storage format."""

    shape: tuple[int, ...]
    format: Format


def table(shape: Shape, mix: str = "f32") -> dict[str, Stub]:
    formats = tensor_formats(shape, mix)
    return {name: Stub(dims, formats[name]) for name, dims in tensor_shapes(shape).items()}


def meta(shape: Shape) -> dict[str, Any]:
    return model_metadata(shape, "test", 0) | {"general.architecture": shape.arch}


@st.composite
def shapes(draw) -> Shape:
    kv = draw(st.integers(1, 3))
    return Shape(
        arch=draw(st.sampled_from(("qwen2", "qwen3"))),
        n_embd=draw(st.integers(4, 48)),
        n_layers=draw(st.integers(1, 3)),
        n_heads=kv * draw(st.integers(1, 3)),
        n_kv_heads=kv,
        head_dim=2 * draw(st.integers(1, 8)),
        n_ff=draw(st.integers(1, 40)),
        vocab=draw(st.integers(1, 40)),
        context=draw(st.integers(1, 5000)),
        rope_base=draw(st.sampled_from((10_000.0, 1_000_000.0))),
        tied=draw(st.booleans()),
    )


# --- configs -----------------------------------------------------------------------------------------------


@given(shapes())
@settings(max_examples=100, deadline=None)
def test_config_is_read_from_metadata(shape):
    cfg = config_of(meta(shape), table(shape))
    assert (cfg.arch, cfg.n_embd, cfg.n_layers, cfg.n_ff, cfg.context) == (
        shape.arch,
        shape.n_embd,
        shape.n_layers,
        shape.n_ff,
        shape.context,
    )
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (shape.n_heads, shape.n_kv_heads, shape.head_dim)
    assert cfg.vocab == shape.vocab and cfg.tied == shape.tied
    assert cfg.qkv_bias == (shape.arch == "qwen2") and cfg.qk_norm == (shape.arch == "qwen3")
    assert cfg.rope_base == shape.rope_base and cfg.rms_eps == pytest.approx(shape.rms_eps)


def test_qwen3_head_size_comes_from_key_length():
    # Qwen3-0.6B: 16 heads of 128 over a 1024-wide model, so q is 2048 wide, not n_embd
    shape = SHAPES["qwen3-0.6b"]
    m = meta(shape)
    assert m["qwen3.attention.key_length"] == 128
    cfg = config_of(m, table(shape))
    assert (cfg.head_dim, cfg.q_width, cfg.kv_width) == (128, 2048, 1024)


def test_qwen2_head_size_defaults_to_width_over_heads():
    shape = SHAPES["qwen2.5-0.5b"]
    m = meta(shape)
    assert "qwen2.attention.key_length" not in m
    assert config_of(m, table(shape)).head_dim == 896 // 14


def test_an_odd_head_size_is_refused():
    # rope rotates pairs of values: an odd head would fail deep in the lane instead of naming the cause
    shape = SHAPES["tiny-qwen3"]
    odd = dataclasses.replace(shape, head_dim=16)
    tensors = table(odd)
    m = meta(odd) | {"qwen3.attention.key_length": 15, "qwen3.attention.value_length": 15}
    q, kv = 15 * odd.n_heads, 15 * odd.n_kv_heads
    for i in range(odd.n_layers):
        b = f"blk.{i}."
        tensors |= {
            b + "attn_q.weight": Stub((q, odd.n_embd), Format.F32),
            b + "attn_k.weight": Stub((kv, odd.n_embd), Format.F32),
            b + "attn_v.weight": Stub((kv, odd.n_embd), Format.F32),
            b + "attn_output.weight": Stub((odd.n_embd, q), Format.F32),
            b + "attn_q_norm.weight": Stub((15,), Format.F32),
            b + "attn_k_norm.weight": Stub((15,), Format.F32),
        }
    with pytest.raises(ModelError, match="15"):
        config_of(m, tensors)


# --- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mamba", "gemma3", ""])
def test_unknown_architecture_is_named(arch):
    shape = SHAPES["tiny-qwen2"]
    with pytest.raises(ModelError, match=f"'{arch}'.*not supported"):
        config_of(meta(shape) | {"general.architecture": arch}, table(shape))


def test_missing_architecture_is_named():
    shape = SHAPES["tiny-qwen2"]
    m = meta(shape)
    del m["general.architecture"]
    with pytest.raises(ModelError, match="general.architecture"):
        config_of(m, table(shape))


@given(shapes(), st.data())
@settings(max_examples=100, deadline=None)
def test_missing_metadata_key_is_named(shape, data):
    m = meta(shape)
    required = [
        f"{shape.arch}.{k}"
        for k in ("embedding_length", "attention.head_count", "block_count", "feed_forward_length", "context_length")
    ]
    key = data.draw(st.sampled_from(required))
    del m[key]
    with pytest.raises(ModelError, match=key):
        config_of(m, table(shape))


@pytest.mark.parametrize("value", ["two", 2.5, -1, 0, True])
def test_metadata_of_the_wrong_kind_is_named(value):
    shape = SHAPES["tiny-qwen3"]
    with pytest.raises(ModelError, match="qwen3.block_count"):
        config_of(meta(shape) | {"qwen3.block_count": value}, table(shape))


@given(shapes(), st.data())
@settings(max_examples=150, deadline=None)
def test_a_missing_tensor_is_named(shape, data):
    tensors = table(shape)
    # output.weight is optional: without it the model is tied to its embedding table
    name = data.draw(st.sampled_from(sorted(n for n in tensors if n != "output.weight")))
    del tensors[name]
    with pytest.raises(ModelError, match=f"'{name}'.*missing"):
        config_of(meta(shape), tensors)


@given(shapes(), st.data())
@settings(max_examples=150, deadline=None)
def test_a_tensor_of_the_wrong_shape_is_named(shape, data):
    tensors = table(shape)
    # the embedding's row count is the vocabulary, which nothing else states: its row length can be wrong
    name = data.draw(st.sampled_from(sorted(tensors)))
    dims = list(tensors[name].shape)
    axis = len(dims) - 1 if name == "token_embd.weight" else data.draw(st.integers(0, len(dims) - 1))
    dims[axis] += data.draw(st.sampled_from((-1, 1, 7))) if dims[axis] > 1 else 1
    tensors[name] = Stub(tuple(dims), tensors[name].format)
    with pytest.raises(ModelError, match=f"'{name}'"):
        config_of(meta(shape), tensors)


def test_an_extra_dimension_is_a_wrong_shape():
    shape = SHAPES["tiny-qwen2"]
    tensors = table(shape) | {"blk.1.ffn_down.weight": Stub((1, 64, 128), Format.F32)}
    with pytest.raises(ModelError, match="'blk.1.ffn_down.weight' has shape"):
        config_of(meta(shape), tensors)


def test_a_quantized_vector_is_refused():
    shape = SHAPES["tiny-qwen2"]
    tensors = table(shape) | {"blk.0.attn_q.bias": Stub((64,), Format.Q8_0)}
    with pytest.raises(ModelError, match="'blk.0.attn_q.bias'.*Q8_0"):
        config_of(meta(shape), tensors)


def test_more_layers_than_block_count_is_refused():
    shape = SHAPES["tiny-qwen3"]
    tensors = table(dataclasses.replace(shape, n_layers=3))
    with pytest.raises(ModelError, match="block_count"):
        config_of(meta(shape), tensors)


# --- graphs ------------------------------------------------------------------------------------------------


def layer_ops(arch: str, i: int) -> list[tuple[str, tuple[str, ...]]]:
    """The primitive ops of layer `i`, in order, each with the weights it reads."""
    b = f"blk.{i}."

    def w(*names: str) -> tuple[str, ...]:
        return tuple(b + n for n in names)

    def proj(x: str) -> list[tuple[str, tuple[str, ...]]]:
        # qwen2 adds a bias after each of the q, k and v products
        return [("Matmul", w(f"attn_{x}.weight"))] + ([("Elementwise.add", w(f"attn_{x}.bias"))] * (arch == "qwen2"))

    qk_norm = [
        ("RmsNorm", ()),
        ("Elementwise.mul", w("attn_q_norm.weight")),
        ("RmsNorm", ()),
        ("Elementwise.mul", w("attn_k_norm.weight")),
    ]
    return [
        ("RmsNorm", ()),
        ("Elementwise.mul", w("attn_norm.weight")),
        *proj("q"),
        *proj("k"),
        *proj("v"),
        *(qk_norm if arch == "qwen3" else []),
        ("Rope", ()),
        ("Rope", ()),
        ("SetRow", ()),
        ("SetRow", ()),
        ("Attention", ()),
        ("Matmul", w("attn_output.weight")),
        ("Elementwise.add", ()),
        ("RmsNorm", ()),
        ("Elementwise.mul", w("ffn_norm.weight")),
        ("Matmul", w("ffn_gate.weight")),
        ("Matmul", w("ffn_up.weight")),
        ("Unary.silu", ()),
        ("Elementwise.mul", ()),
        ("Matmul", w("ffn_down.weight")),
        ("Elementwise.add", ()),
    ]


def expected_ops(shape: Shape, rows: int = 1, all_logits: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    head = "token_embd.weight" if shape.tied else "output.weight"
    ops = [("RowsGather", ("token_embd.weight",))]
    for i in range(shape.n_layers):
        ops += layer_ops(shape.arch, i)
    if rows > 1 and not all_logits:
        ops.append(("TakeRows", ()))
    return ops + [("RmsNorm", ()), ("Elementwise.mul", ("output_norm.weight",)), ("Matmul", (head,))]


def signature(g: TensorGraph) -> list[tuple[str, tuple[str, ...]]]:
    out = []
    for op in g.ops:
        spec = op.prim()
        kind = type(spec).__name__ + (f".{spec.op.value}" if isinstance(spec, Elementwise | Unary) else "")
        out.append((kind, tuple(n for n in reads(op) if g.tensors[n].role is Role.WEIGHT)))
    return out


def check_dataflow(g: TensorGraph) -> None:
    """Each op reads what exists before the step or what an earlier op wrote; each value is written once
    and read later (nothing computed is thrown away); every weight is used; the logits are produced."""
    written: set[str] = set()
    for i, op in enumerate(g.ops):
        for name in reads(op):
            assert name in g.tensors, f"op {i} reads undeclared {name}"
            assert g.tensors[name].role in AVAILABLE or producers(g.ops[:i], name), f"op {i} reads {name} early"
        assert op.out == op.dst.buf and writes(op) == (op.out,)
        role = g.tensors[op.out].role
        if role is Role.CACHE:
            assert op.dst.row is not None, f"op {i} overwrites the whole cache {op.out}"
        else:
            assert role in (Role.ACTIVATION, Role.OUTPUT) and op.out not in written, f"op {i} rewrites {op.out}"
            written.add(op.out)
    for name in written - set(g.outputs):
        assert readers(g.ops, name), f"{name} is computed and never read"
    for name, t in g.tensors.items():
        if t.role is Role.WEIGHT:
            assert readers(g.ops, name), f"weight {name} is never read"
    assert set(g.outputs) == {LOGITS} and LOGITS in written


def check_kv_writes(g: TensorGraph, shape: Shape, ctx: int) -> None:
    """Each layer writes its roped k and its v into its caches at the row `pos`, before attention reads them."""
    kv_width = shape.n_kv_heads * shape.head_dim
    for i in range(shape.n_layers):
        caches = (f"blk.{i}.k_cache", f"blk.{i}.v_cache")
        for cache in caches:
            assert g.tensors[cache].role is Role.CACHE and g.tensors[cache].shape == (ctx, kv_width)
            (w,) = producers(g.ops, cache)
            op = g.ops[w]
            assert isinstance(op.prim(), SetRow) and op.dst.row == RowAt(POS, kv_width) and op.ins[1] == POS
            (source,) = producers(g.ops, op.ins[0])
            # keys are cached after rotation, values as they are
            assert isinstance(g.ops[source].prim(), Rope) == cache.endswith("k_cache")
        (a,) = [j for j in readers(g.ops, caches[0]) if isinstance(g.ops[j].prim(), Attention)]
        assert g.ops[a].ins[1:] == (*caches, POS) and a > max(producers(g.ops, c)[0] for c in caches)


@given(shapes(), st.integers(1, 64))
@settings(max_examples=60, deadline=None)
def test_decode_graph(shape, ctx):
    cfg = config_of(meta(shape), table(shape))
    g = recognize(cfg, table(shape), Form.DECODE, ctx=ctx)
    assert g.form is Form.DECODE and g.rows == 1
    assert g.inputs == (IDS,) and g.params == (POS,) and g.tensors[IDS].shape == (1,)
    assert signature(g) == expected_ops(shape)
    check_dataflow(g)
    check_kv_writes(g, shape, ctx)
    assert g.tensors[LOGITS].shape == (1, shape.vocab)
    for op in g.ops:
        spec = op.prim()
        if isinstance(spec, Attention):
            assert (spec.heads, spec.kv_heads, spec.hd, spec.len) == (
                shape.n_heads,
                shape.n_kv_heads,
                shape.head_dim,
                ctx,
            )
            assert spec.scale == pytest.approx(1 / math.sqrt(shape.head_dim))
        if isinstance(spec, Rope):
            assert op.ins[1] == POS and spec.hd == shape.head_dim and spec.base == shape.rope_base


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qk_norms_are_per_head(arch):
    shape = SHAPES[f"tiny-{arch}"]
    g = recognize(config_of(meta(shape), table(shape)), table(shape), Form.DECODE, ctx=8)
    per_head = [
        (op.prim().rows, op.prim().cols)
        for op in g.ops
        if isinstance(op.prim(), RmsNorm) and op.prim().cols == shape.head_dim
    ]
    norms = [(shape.n_heads, shape.head_dim), (shape.n_kv_heads, shape.head_dim)] * shape.n_layers
    assert per_head == (norms if arch == "qwen3" else [])


@given(shapes(), st.integers(2, 9), st.booleans())
@settings(max_examples=60, deadline=None)
def test_prefill_graph(shape, rows, all_logits):
    ctx = rows + 3
    cfg = config_of(meta(shape), table(shape))
    g = recognize(cfg, table(shape), Form.PREFILL, rows=rows, ctx=ctx, all_logits=all_logits)
    assert g.form is Form.PREFILL and g.tensors[IDS].shape == (rows,)
    assert signature(g) == expected_ops(shape, rows, all_logits)
    check_dataflow(g)
    check_kv_writes(g, shape, ctx)
    # logits for the sampling row only, unless every row's are asked for
    assert g.tensors[LOGITS].shape == ((rows if all_logits else 1), shape.vocab)
    take = [op.prim() for op in g.ops if isinstance(op.prim(), TakeRows)]
    assert take == ([] if all_logits else [TakeRows(rows, shape.n_embd, 1)])


def test_a_decode_step_is_one_row():
    shape = SHAPES["tiny-qwen2"]
    with pytest.raises(ValueError):
        recognize(config_of(meta(shape), table(shape)), table(shape), Form.DECODE, rows=2, ctx=8)


def test_the_recognizer_is_chosen_by_architecture():
    for name in ("tiny-qwen2", "tiny-qwen3"):
        shape = SHAPES[name]
        assert recognizer(config_of(meta(shape), table(shape))).recognize is recognize


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_prefill_logits_are_the_decode_steps_logits(tmp_path, arch):
    # the graphs run: one chunk's every-row logits match one decode step per token, in f64
    from fuselane.runtime.model import load

    m = load(write_synthetic(tmp_path / "m.gguf", f"tiny-{arch}", "q8_0", seed=3), lane="cpu", ctx=16, dtype=np.float64)
    try:
        ids = np.array([5, 77, 300, 12, 499, 8])
        chunk = m.lane.forward(ids, 0, all_logits=True)
        last = m.lane.forward(ids, 0)
        steps = np.concatenate([m.lane.forward(ids[i : i + 1], i) for i in range(len(ids))])
    finally:
        m.close()
    assert chunk.shape == (len(ids), 512) and last.shape == (1, 512)
    np.testing.assert_allclose(chunk, steps, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(last[0], chunk[-1], rtol=1e-9, atol=1e-9)
