"""The launch budget of a decode step: at most LAUNCH_BUDGET launches a layer on every dense Qwen shape
published (0.5B to 72B, Qwen2.5 and Qwen3) in every quantization mix the synthetic writer knows (the grid mixes
held to their own count), not only the four of ANCHORS.md, at the lane's default knobs and under dequantized
activations; and on those shapes and the Qwen mixtures' at every setting of the knobs that move launches.

Plans are built from tensor stubs (shapes and the mix's formats), so no file is written. Each shape keeps its
widths at LAYERS layers: a layer's launches depend on its widths and its tensors' formats, and the recipes give
a layer more bits in the first and last eighth and every third layer between, so eight layers hold every
combination of formats a layer of the real depth has.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from fuselane.explain import launches_per_layer as plan_launches
from fuselane.fuse.optimizer import covered, optimize
from fuselane.gguf.synth import SHAPES, Mix, Shape, model_metadata, tensor_formats, tensor_shapes
from fuselane.gguf.synth_recipes import GRID_MIXES
from fuselane.graph.ir import Form
from fuselane.lanes.cuda.plan.kernels import QBLOCK
from fuselane.lanes.cuda.plan.knobs import Activations, CudaKnobs
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.models import config_of, recognizer
from tests.lanes.test_cuda_launches import Stub, launches_per_layer

LAUNCH_BUDGET = 7  # a decode step's launches a layer
LAYERS = 8
# every mix but the grid ones (`synth_recipes.GRID_MIXES`, held to their own counts below) and the 0.5B file's order
BUDGET_MIXES = [m for m in Mix if m is not Mix.Q4_K_M_05B and m not in GRID_MIXES]

# The published dense configs: the synthetic writer's shapes (their vocabularies one size, which a layer's
# launches do not see) and Qwen2.5-72B. Qwen2.5's 14B, 32B and 72B are where a norm wider than a block first
# appears.
PUBLISHED = {name: shape for name, shape in SHAPES.items() if shape.arch in ("qwen2", "qwen3") and "tiny" not in name}
PUBLISHED["qwen2.5-72b"] = Shape("qwen2", 8192, 80, 64, 8, 128, 29568, 152064)

# A dense Qwen-like shape of the checkpoints people train and convert: heads of a width Qwen uses, any number of
# key/value heads and of query heads a key head, the queries' width within half and twice the hidden width, the
# hidden width whole 64-value blocks, the FFN two to six times as wide.
HEAD_DIMS = (8, 16, 48, 64, 80, 96, 128, 256)  # 8, 16, 48, 80: heads that are not whole 32-value blocks
KV_HEADS = (1, 2, 4, 8)
QUERY_GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # 16: Qwen3-235B-A22B's 64 over 4
EMBD_UNIT = 64
# ...up to 16,384 values (twice Qwen2.5-72B's): the FFN's rows, six times that, stay within the int8 products'
# 32-bit sums (`holds_accumulator`: 2^31 / 127^2 terms), which the lane refuses past
MOST_UNITS = 256
FFN_RATIOS = (2, 6)
SHAPE_EXAMPLES = 150


@st.composite
def qwen_like(draw) -> Shape:
    hd, kv = draw(st.sampled_from(HEAD_DIMS)), draw(st.sampled_from(KV_HEADS))
    heads = kv * draw(st.sampled_from(QUERY_GROUPS))
    q = heads * hd
    assume(q % QBLOCK == 0)  # a quantized file's rows are whole blocks: an odd count of heads of 48 is not
    units = draw(st.integers(max(8, -(-q // 2) // EMBD_UNIT), min(MOST_UNITS, max(8, 2 * q // EMBD_UNIT))))
    embd = units * EMBD_UNIT
    ff = EMBD_UNIT * draw(st.integers(FFN_RATIOS[0] * units, FFN_RATIOS[1] * units))
    arch = draw(st.sampled_from(("qwen2", "qwen3")))
    return Shape(arch, embd, LAYERS, heads, kv, hd, ff, 1024, tied=draw(st.booleans()))


def _decode_graph(shape: Shape, name: str, mix: Mix):
    """A decode step's graph of `shape` in `mix`, from tensor stubs, and its config."""
    formats = tensor_formats(shape, mix)
    tensors = {n: Stub(dims, formats[n]) for n, dims in tensor_shapes(shape).items()}
    cfg = config_of(model_metadata(shape, name, 0) | {"general.architecture": shape.arch}, tensors)
    return recognizer(cfg).recognize(cfg, tensors, Form.DECODE, rows=1, ctx=4096), cfg


@pytest.mark.parametrize("mix", BUDGET_MIXES)
@pytest.mark.parametrize("name", PUBLISHED)
def test_a_decode_step_takes_at_most_the_budget_a_layer(name: str, mix: Mix) -> None:
    g, _ = _decode_graph(replace(PUBLISHED[name], n_layers=LAYERS), name, mix)
    plan = optimize(g, CudaShim(CudaKnobs()))
    assert sorted(covered(plan)) == list(range(len(g.ops)))
    per_layer = launches_per_layer(g, plan)
    worst = max(per_layer, key=per_layer.__getitem__)
    assert per_layer[worst] <= LAUNCH_BUDGET, f"layer {worst} takes {per_layer[worst]} launches"


@settings(max_examples=SHAPE_EXAMPLES, deadline=None)
@given(
    shape=qwen_like(),
    mix=st.sampled_from(BUDGET_MIXES),
    activations=st.sampled_from([Activations.INT8, Activations.DEQUANT]),
)
@example(shape=Shape("qwen2", 1024, LAYERS, 8, 1, 128, 2752, 1024), mix=Mix.Q5_0, activations=Activations.INT8)
# a query past twice the hidden width: only the down projection's norm leaves its epilogue (8 before)
@example(shape=Shape("qwen2", 640, LAYERS, 14, 2, 96, 1344, 1024), mix=Mix.Q8_0, activations=Activations.INT8)
# heads of 48 under dequant: a wide query and a narrow key share the GEMV by rows' launch (8 before)
@example(shape=Shape("qwen2", 1024, LAYERS, 12, 4, 48, 2048, 1024), mix=Mix.Q6_K, activations=Activations.DEQUANT)
# heads of 16 in groups of three (a packed group's output shares a 32-value block with the next group's) and of
# 8 (a CUDA-core block's): the attention writes its int8 form through seams (a Quantize launch, 8, before)
@example(shape=Shape("qwen3", 512, LAYERS, 48, 16, 16, 1536, 1024), mix=Mix.Q4_K_M, activations=Activations.INT8)
@example(shape=Shape("qwen2", 512, LAYERS, 64, 8, 8, 1536, 1024), mix=Mix.Q8_0, activations=Activations.INT8)
def test_any_qwen_like_shape_keeps_the_budget(shape: Shape, mix: Mix, activations: Activations) -> None:
    # whatever the widths: a narrow key and value beside a wide query (one key head of 128) share the QKV
    # launch, which the GEMV by rows' tiles of four rows a warp had kept apart
    g, _ = _decode_graph(shape, "qwen-like", mix)
    plan = optimize(g, CudaShim(CudaKnobs(activations=activations)))
    assert sorted(covered(plan)) == list(range(len(g.ops)))
    assert max(launches_per_layer(g, plan).values()) <= LAUNCH_BUDGET


@pytest.mark.parametrize("mix", BUDGET_MIXES)
@pytest.mark.parametrize("name", PUBLISHED)
def test_f32_activations_keep_the_budget(name: str, mix: Mix) -> None:
    # activations=dequant: a projection's last program norms a row wider than its block holds in chunks, so
    # the 14B's to the 72B's widths in Q5_K_M and Q4_0 keep their norm in the projection (8 launches before);
    # a step's Q2_K, Q3_K and IQ4_XS products take the GEMV by rows, a value at a time (11-13 launches as a
    # chunk's decode and cuBLAS)
    g, _ = _decode_graph(replace(PUBLISHED[name], n_layers=LAYERS), name, mix)
    plan = optimize(g, CudaShim(CudaKnobs(activations=Activations.DEQUANT)))
    assert max(launches_per_layer(g, plan).values()) <= LAUNCH_BUDGET


@pytest.mark.parametrize("activations", [Activations.INT8, Activations.DEQUANT])
@pytest.mark.parametrize("mix", sorted(GRID_MIXES, key=lambda m: m.value))
@pytest.mark.parametrize("name", PUBLISHED)
def test_the_grid_mixes_keep_the_budget(name, mix, activations) -> None:
    # a step's q and k grid products share the grid GEMV in parts, their rotations in its epilogue; the value
    # product (Q4_K) lands apart. Under int8 the grid gated pair writes its int8 form for a down product that
    # reads it (IQ3_M's first eighth in Q4_K), and a grid down product reads the pair's int8 form in dp4a
    shape = replace(PUBLISHED[name], n_layers=LAYERS)
    g, _ = _decode_graph(shape, name, mix)
    per_layer = launches_per_layer(g, optimize(g, CudaShim(CudaKnobs(activations=activations))))
    assert max(per_layer.values()) <= LAUNCH_BUDGET, per_layer


@pytest.mark.parametrize("mix", [Mix.Q4_K_M, Mix.Q8_0])
@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3-8b"])
def test_a_yarn_file_keeps_the_budget(name: str, mix: Mix) -> None:
    # YaRN's stretched frequencies turn in the same fused rotations (and the QKV GEMV's epilogue) as the base's
    g, cfg = _decode_graph(replace(PUBLISHED[name], n_layers=LAYERS, yarn_factor=4.0, yarn_original=32768), name, mix)
    assert cfg.yarn is not None
    assert max(launches_per_layer(g, optimize(g, CudaShim(CudaKnobs()))).values()) <= LAUNCH_BUDGET


# The knobs whose settings change a decode step's launches: its numerics, where the query's and key's rotations
# turn, and whether a down projection's add and norm take a launch of their own.
LAUNCH_KNOBS = [
    [f"activations={a}", f"rope_epilogue={r}", f"norm_launch={n}"]
    for a in ("int8", "dequant")
    for r in ("auto", "on", "off")
    for n in ("on", "off")
]
MIXTURES = [name for name, shape in SHAPES.items() if shape.arch in ("qwen2moe", "qwen3moe", "qwen3next")]


@pytest.mark.parametrize("name", [*PUBLISHED, *(m for m in MIXTURES if "tiny" not in m)])
def test_every_launch_knob_keeps_the_budget(name: str) -> None:
    # every setting of the knobs that move launches, on every Qwen shape and mix: a setting no benchmark runs
    # keeps the budget too (Qwen3-Next's K and IQ recipes under dequant took 8 a layer before the f32 GEMV by
    # rows took a step's two formats)
    shape = replace(SHAPES.get(name) or PUBLISHED[name], n_layers=LAYERS)
    for mix in BUDGET_MIXES:
        g, _ = _decode_graph(shape, name, mix)
        for knobs in LAUNCH_KNOBS:
            per_layer = plan_launches(optimize(g, CudaShim(CudaKnobs.parse(knobs))))  # a view is no launch
            assert max(per_layer.values()) <= LAUNCH_BUDGET, (mix.value, knobs, per_layer)
