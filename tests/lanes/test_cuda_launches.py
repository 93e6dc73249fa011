"""The cuda lane's decode plans at the real models' shapes (shared/ANCHORS.md): launches per layer, with the
lane rule `gemv_parts` and with it held.

Graphs are recognized from a table of tensor stubs (shape and format, from the synthetic checkpoints' recipes),
so no file is written. Run with `-s` to see each plan's launches per layer and classes.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import pytest

from fuselane.fuse.optimizer import covered, optimize
from fuselane.gguf.formats import Format
from fuselane.gguf.synth import SHAPES, model_metadata, tensor_formats, tensor_shapes
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Form, Fused, Op, TensorGraph
from fuselane.graph.ops import RowsGather
from fuselane.lanes.cuda.plan import kernels
from fuselane.lanes.cuda.plan.knobs import Activations, CudaKnobs, RopeEpilogue
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.models import config_of, qwen


@dataclass(frozen=True)
class Stub:
    shape: tuple[int, ...]
    format: Format


ANCHORS = {"qwen2.5-0.5b": "q4_k_m_05b", "qwen3-0.6b": "q8_0", "qwen2.5-7b": "q4_k_m", "qwen3-8b": "q4_k_m"}
LAYER = re.compile(r"^(?:l|blk\.)(\d+)\.")


def decode_graph(name: str) -> tuple[TensorGraph, int]:
    shape = SHAPES[name]
    formats = tensor_formats(shape, ANCHORS[name])
    tensors = {n: Stub(dims, formats[n]) for n, dims in tensor_shapes(shape).items()}
    cfg = config_of(model_metadata(shape, name, 0) | {"general.architecture": shape.arch}, tensors)
    return qwen.recognize(cfg, tensors, Form.DECODE, ctx=4096), cfg.n_layers


def launches_per_layer(g: TensorGraph, plan) -> Counter[int]:
    """Launches by layer. An original op belongs to the layer its output is named for (`l3.q`, `blk.3.k_cache`);
    a launch to the first layer among the ops it covers. Launches covering the embedding gather or the output
    head's product (which cover no layer's op but the first layer's input norm and the last one's output
    norm) are left out: what remains, over the layers, is the launches a layer costs. A launch the lane adds
    (a `Quantize`, covering no op of the graph) goes with the launch that wrote what it quantizes."""
    layer_of = {i: int(m.group(1)) for i, op in enumerate(g.ops) if (m := LAYER.match(op.out))}
    edges = {i for i, op in enumerate(g.ops) if isinstance(op.sym, RowsGather) or op.out == qwen.LOGITS}
    counts: Counter[int] = Counter()
    writer: dict[str, int | None] = {}  # a value's writer's layer (None: an edge's)
    for op in plan.ops:
        if op.covers:
            layer = None if edges & set(op.covers) else min(layer_of[c] for c in op.covers if c in layer_of)
        else:
            layer = writer[op.ins[0]]
        writer[op.out] = layer
        if layer is not None:
            counts[layer] += 1
    return counts


def classes(plan) -> Counter[str]:
    """The plan's launches by class (a primitive's by its spec)."""
    return Counter(op.sym.cls.value if isinstance(op.sym, Fused) else type(op.sym).__name__ for op in plan.ops)


def folded(plan, cls: C) -> int:
    """How many folds of `cls` the plan holds, at any depth (a quantizing epilogue wraps its producer)."""

    def count(op: Op) -> int:
        if not isinstance(op.sym, Fused):
            return 0
        return (op.sym.cls is cls) + sum(count(p) for p in op.sym.parts)

    return sum(count(op) for op in plan.ops)


@pytest.fixture(scope="module", params=list(ANCHORS))
def anchor(request) -> tuple[str, TensorGraph, int]:
    g, layers = decode_graph(request.param)
    return request.param, g, layers


@pytest.mark.parametrize("activations", [Activations.DEQUANT, Activations.INT8])
def test_decode_launches_per_layer(anchor, activations: Activations) -> None:
    name, g, layers = anchor
    knobs = CudaKnobs(activations=activations)
    plan = optimize(g, CudaShim(knobs))
    held = optimize(g, CudaShim(knobs, held=("gemv_parts",)), held=("gemv_parts",))
    for p in (plan, held):
        assert sorted(covered(p)) == list(range(len(g.ops)))  # every original op once
    per_layer, per_layer_held = launches_per_layer(g, plan), launches_per_layer(g, held)
    assert sorted(per_layer) == list(range(layers))
    mean = sum(per_layer.values()) / layers
    print(
        f"\n{name} decode, {activations.value}: {plan.launches()} launches, {mean:.2f} a layer "
        f"(most {max(per_layer.values())}); gemv_parts held: {sum(per_layer_held.values()) / layers:.2f} a layer"
        f"\n  classes: {dict(classes(plan))}"
    )
    # every layer folds its projections' residual add and norm into their last block, but under int8's
    # norm_launch (on by default) the down projection's, which takes a launch of its own
    shape = SHAPES[name]
    own = knobs.norm_launch and kernels.norm_in_own_launch(kernels.mode(activations), shape.n_ff, shape.n_embd)
    assert own == (activations is Activations.INT8)
    assert folded(plan, C.GEMV_NORM_EPILOGUE) == (1 if own else 2) * layers
    assert max(per_layer.values()) <= 7
    assert held.launches() > plan.launches()
    assert any(f.rule == "gemv_parts" for f in plan.fired) and not any(f.rule == "gemv_parts" for f in held.fired)


def test_norm_launch_takes_only_the_down_projections_norm_out_of_its_epilogue(anchor) -> None:
    # norm_launch=on under int8: the down projection's add and norm (AddNormQuant) take a launch of their own
    # (`kernels.norm_in_own_launch`); the attention output projection's stay in its last block
    name, g, layers = anchor
    shape = SHAPES[name]
    plan = optimize(g, CudaShim(CudaKnobs(activations=Activations.INT8, norm_launch=True)))
    assert sorted(covered(plan)) == list(range(len(g.ops)))
    assert kernels.norm_in_own_launch(kernels.Mode.INT8, shape.n_ff, shape.n_embd)
    assert not kernels.norm_in_own_launch(kernels.Mode.INT8, shape.n_heads * shape.head_dim, shape.n_embd)
    assert folded(plan, C.GEMV_NORM_EPILOGUE) == layers
    assert classes(plan)["AddNormQuant"] == layers
    # the query's and key's rotations kept apart in both (`rope_epilogue=auto` folds them into the QKV GEMV
    # under norm_launch only), so the one launch a layer more is the norm's
    apart = CudaKnobs(activations=Activations.INT8, norm_launch=True, rope_epilogue=RopeEpilogue.OFF)
    per_layer = launches_per_layer(g, optimize(g, CudaShim(apart)))
    kept = CudaKnobs(activations=Activations.INT8, norm_launch=False, rope_epilogue=RopeEpilogue.OFF)
    in_epilogue = launches_per_layer(g, optimize(g, CudaShim(kept)))
    assert all(per_layer[i] == in_epilogue[i] + 1 for i in range(layers))
