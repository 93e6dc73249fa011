"""The plan is what runs: the launches a lane binds (the cuda lane) or the kernels it executes (the cpu lane)
are, layer by layer, the schedule `fuselane explain` prints, one entry a launch; and every class the cuda shim
runs natively has its binder in the lane's one table.

The cuda lane is bound under Triton's interpreter on the host: binding builds the launches from the plan
(closures over the buffers), and none runs, so every form, knob and held rule is cheap to check.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pytest

from fuselane.explain import build_plan, launch_layers, launches_per_layer
from fuselane.fuse.optimizer import VIEWS, launches_of, optimize, rule_names
from fuselane.fuse.shim import NATIVE, Support, SupportKind
from fuselane.fuse.views import class_of
from fuselane.gguf.synth import Shape, write_synthetic
from fuselane.gguf.synth_latent import LATENT_SHAPES
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Form
from fuselane.graph.ops import Quantize
from fuselane.lanes.cuda.plan.classes import NATIVE_CLASSES, QUANT_EPILOGUES
from fuselane.lanes.cuda.plan.gdn import DELTA_FORM_LAUNCHES, DELTA_SPLIT, step_writes_int8
from fuselane.lanes.cuda.plan.knobs import Activations, CudaKnobs
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.lanes.cuda.run.launch import BINDERS, PARTS_ONLY
from fuselane.models import recognizer

CTX = 32
PREFILL_ROWS = 11  # past the GEMV's rows: the GEMMs, the chunk attention and the last row's view run
SHORT_ROWS = 4  # within the GEMV's rows
BATCH_ROWS = 3
WIDE_BATCH_ROWS = 16  # past the GEMV's rows: a batch's products take the chunk's GEMMs

# Shapes the lane's int8 kernels take (rows of whole 32-value blocks; Q8_0, and Q4_K / Q6_K rows of 256), and
# one they do not (f16 rows): qwen3's Q4_K_M has a Q6_K attn_v in one layer, which the QKV GEMV leaves out.
MODELS = {
    "qwen2-q8_0": (Shape("qwen2", 128, 2, 4, 2, 32, 256, 512, context=4096), "q8_0"),
    "qwen3-q4_k_m": (Shape("qwen3", 256, 2, 4, 2, 64, 768, 512, context=4096), "q4_k_m"),
    "qwen3-f16": (Shape("qwen3", 64, 2, 4, 2, 16, 128, 512, context=4096), "f16"),
    # mixtures: the kept experts' rows Q4_K / Q6_K of 256, or Q8_0 with a shared expert
    "qwen3moe-q4_k_m": (
        Shape("qwen3moe", 256, 2, 4, 2, 64, 768, 512, context=4096, experts=8, experts_used=2, expert_ff=256),
        "q4_k_m",
    ),
    "qwen2moe-q8_0": (
        Shape(
            "qwen2moe", 128, 2, 4, 2, 32, 256, 512, context=4096, experts=8, experts_used=2, expert_ff=64, shared_ff=128
        ),
        "q8_0",
    ),
    # latent attention, absorbed: V2's routing, and V3's (sigmoid with the bias, q LoRA, YaRN) in one group
    "deepseek2-q8_0": (LATENT_SHAPES["tiny-deepseek2"], "q8_0"),
    "deepseek3-ungrouped-q8_0": (
        replace(LATENT_SHAPES["tiny-deepseek3"], groups=1, groups_used=1, q_lora=64, weights_scale=2.5),
        "q8_0",
    ),
}
KNOBS = [
    (),
    ("activations=dequant",),
    ("fuse_quant=off",),
    ("rope_epilogue=on",),
    ("rope_epilogue=off",),
    ("norm_launch=off",),
    ("norm_launch=off", "rope_epilogue=on"),
    ("pdl=off", "cache=f32"),
    ("prefill=in-place",),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        name: str(write_synthetic(root / f"{name}.gguf", shape, mix, seed=3)) for name, (shape, mix) in MODELS.items()
    }


def per_layer(ops_and_counts) -> dict[int, int]:
    """Launches by layer, attributed as `explain` attributes them, counting what each op really launched."""
    ops = [op for op, _ in ops_and_counts]
    counts: Counter[int] = Counter()
    for layer, (_, n) in zip(launch_layers(ops), ops_and_counts, strict=True):
        if layer is not None:
            counts[layer] += n
    return dict(sorted(counts.items()))


# --- the binder table (no torch needed) ------------------------------------------------------------------


def unbound_native(shim) -> set[C]:
    """Classes `shim` answers native for that the cuda lane's table has no binder for."""
    return {
        cls
        for cls in C
        if shim.supports(cls).kind is SupportKind.NATIVE and cls not in BINDERS and PARTS_ONLY.get(cls) not in BINDERS
    }


@pytest.mark.parametrize("activations", list(Activations))
@pytest.mark.parametrize("fuse_quant", [True, False])
def test_every_native_class_has_its_binder(activations: Activations, fuse_quant: bool) -> None:
    shim = CudaShim(CudaKnobs(activations=activations, fuse_quant=fuse_quant))
    assert unbound_native(shim) == set()


def test_the_table_binds_no_class_the_shim_does_not_run() -> None:
    classes = {key for key in BINDERS if isinstance(key, C)}
    assert classes == NATIVE_CLASSES - set(PARTS_ONLY) | QUANT_EPILOGUES
    assert set(PARTS_ONLY.values()) <= classes


@dataclass(frozen=True, slots=True)
class _Claims(CudaShim):
    """The cuda shim answering native for one more class: what the binder test must catch."""

    extra: C = C.MLA_UNABSORB_IN_FOLD

    def supports(self, cls: C) -> Support:
        return NATIVE if cls is self.extra else CudaShim.supports(self, cls)


def test_a_native_answer_without_a_binder_is_caught() -> None:
    assert unbound_native(_Claims()) == {C.MLA_UNABSORB_IN_FOLD}


# --- the cuda lane: what binds is what explain prints ----------------------------------------------------

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the lane's device is the host
pytest.importorskip("triton")

from fuselane.lanes.cuda.run.lane import _Step  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402


def _check_step(path: str, step, form: str, rows: int, knobs: tuple[str, ...], held: tuple[str, ...]) -> None:
    bound = [(op, len(launches)) for op, launches in step.bound]
    for op, n in bound:
        assert n == launches_of(op), f"{op.out} launched {n} times"
        # one launch an op but for the lane rules' sizes: Mla's three, a chunk's GdnStep two
        assert n == (0 if isinstance(op.sym, VIEWS) else 1) or class_of(op) in (C.MLA, C.GDN_STEP)
    _, _, told = build_plan(path, lane="cuda", form=form, rows=rows, knobs=knobs, held=held)
    assert step.launches == sum(n for _, n in bound) == told.launches()
    assert per_layer(bound) == launches_per_layer(told)


@pytest.mark.parametrize(("model", "knobs"), list(itertools.product(MODELS, KNOBS)))
def test_cuda_binds_what_explain_prints(paths, model: str, knobs: tuple[str, ...]) -> None:
    lane = load(paths[model], lane="cuda", ctx=CTX, knobs=list(knobs)).lane
    for form, rows in (("decode", 1), ("prefill", SHORT_ROWS), ("prefill", PREFILL_ROWS)):
        _check_step(paths[model], lane.step(rows), form, rows, knobs, ())


@pytest.mark.parametrize("model", ["qwen2-q8_0", "qwen3-q4_k_m"])
def test_cuda_binds_what_explain_prints_with_each_rule_held(paths, model: str) -> None:
    names = rule_names(CudaShim())
    assert "rope_epilogue" not in names and "gemv_parts" in names  # the settling passes are not held
    for rule in [*names, "rows_a_warp"]:
        lane = load(paths[model], lane="cuda", ctx=CTX, held=(rule,)).lane
        for form, rows in (("decode", 1), ("prefill", PREFILL_ROWS)):
            _check_step(paths[model], lane.step(rows), form, rows, (), (rule,))
    everything = tuple(names)
    lane = load(paths[model], lane="cuda", ctx=CTX, held=everything).lane
    _check_step(paths[model], lane.step(1), "decode", 1, (), everything)


@pytest.mark.parametrize("rows", [BATCH_ROWS, WIDE_BATCH_ROWS])
@pytest.mark.parametrize("model", list(MODELS))
def test_cuda_binds_a_batch_plan_as_explain_prints_it(paths, model: str, rows: int) -> None:
    # the lane's runner steps one sequence; a batch's plan binds op for op all the same, within the GEMV's rows
    # and past them (the chunk's GEMMs)
    knobs = ("batch=true",)
    model_ = load(paths[model], lane="cuda", ctx=CTX, knobs=list(knobs))
    lane = model_.lane
    g = recognizer(lane.cfg).recognize(lane.cfg, lane.tensors, Form.BATCH, rows=rows, ctx=CTX)
    step = _Step(lane, optimize(g, lane.shim))
    _check_step(paths[model], step, "batch", rows, knobs, ())


# a gated delta-rule layer (heads the convolution's epilogue norms) and a gated full-attention layer
QWEN3NEXT_SHAPE = Shape(
    *("qwen3next", 64, 2, 4, 2, 16, 128, 512),
    **dict(context=4096, experts=4, experts_used=2, expert_ff=32, shared_ff=32, full_every=2),
    **dict(ssm_k_heads=2, ssm_v_heads=4, ssm_dim=32, conv=4, rope_dim=8),
)
GDN_RULES = (
    *("conv_silu", "conv_silu_l2norm", "gdn_gating", "gdn_gate_projections", "gdn_step", "gated_norm"),
    *("attn_output_gate", "gdn_output_quant", "norm_in_step"),
)


@pytest.mark.parametrize(
    ("mix", "knobs", "held"),
    [
        *(("q8_0", (), ()), ("q8_0", ("activations=dequant", "state=bf16"), ()), ("q8_0", (), GDN_RULES)),
        *(("q8_0", (), (r,)) for r in GDN_RULES),
        # every matrix F16: a step's gates' product rides the GEMV in parts (a chunk's gates take it in their
        # launch), or, with that held, the gates take it in theirs
        *(("f16", (), ()), ("f16", (), ("gdn_gate_projections",)), ("f16", (), ("gemv_parts",))),
    ],
)
def test_cuda_binds_a_qwen3next_plan_as_explain_prints_it(tmp_path, mix, knobs, held) -> None:
    path = str(write_synthetic(tmp_path / "m.gguf", QWEN3NEXT_SHAPE, mix, seed=3))
    lane = load(path, lane="cuda", ctx=CTX, knobs=list(knobs), held=held).lane
    for form, rows in (("decode", 1), ("prefill", PREFILL_ROWS)):
        _check_step(path, lane.step(rows), form, rows, knobs, held)
    classes = {class_of(op) for op, _ in lane.step(1).bound}
    if not held and not knobs:  # the classes this plan is here for are in it
        chunk = {class_of(op) for op, _ in lane.step(PREFILL_ROWS).bound}
        assert mix != "f16" or (C.GDN_GATE_PROJECTIONS in chunk and C.GDN_GATE_PROJECTIONS not in classes)
    if held == ("gemv_parts",):
        assert C.GDN_GATE_PROJECTIONS in classes
        # the gated norm's int8 form written in the decode step's store (`norm_in_step`)
        assert mix == "f16" or any(step_writes_int8(op) for op, _ in lane.step(1).bound)
    # a decode step's delta rule is one launch (the recurrence); a chunk's GdnStep the chunked form's two, and
    # a bare rule's (its class held) one each (the whole form)
    steps = {
        rows: [len(n) for op, n in lane.step(rows).bound if class_of(op) is C.GDN_STEP] for rows in (1, PREFILL_ROWS)
    }
    if "gdn_step" in held:
        assert steps == {1: [], PREFILL_ROWS: []}
    else:
        layers = QWEN3NEXT_SHAPE.n_layers - QWEN3NEXT_SHAPE.n_layers // QWEN3NEXT_SHAPE.full_every
        assert steps == {1: [1] * layers, PREFILL_ROWS: [DELTA_FORM_LAUNCHES[DELTA_SPLIT]] * layers}


def test_rope_epilogue_folds_the_rotations_only_where_the_gemv_turns_them(paths) -> None:
    # qwen3 Q4_K_M: layer 1's V is Q6_K. Under auto its QKV GEMV holds the query and key alone, turning them, and
    # the V its own launch; under off and on the V's rows join the GEMV as a second format (`_formats_mix`), which
    # then turns nothing (off: the rotations in one launch after it) or every head (on)
    path = paths["qwen3-q4_k_m"]
    plans = {v: build_plan(path, lane="cuda", knobs=(f"rope_epilogue={v}",))[2] for v in ("off", "auto", "on")}
    pairs = {v: sum(class_of(op) is C.ROPE_QK_ONE_LAUNCH for op in p.ops) for v, p in plans.items()}
    assert pairs == {"off": 2, "auto": 1, "on": 0}
    values = {v: sum(class_of(op) is C.ROW_WRITE for op in p.ops) for v, p in plans.items()}
    assert values == {"off": 0, "auto": 1, "on": 0}
    assert plans["off"].launches() == plans["auto"].launches() == plans["on"].launches() + 2


# --- the cpu lane: what executes is what explain prints --------------------------------------------------


class _Counted:
    """Counts the ops the cpu lane executes, by the op each top-level call runs."""

    def __init__(self, lane) -> None:
        self.ran: list = []
        self.depth = 0
        real = lane._step

        def step(g, op, env, pos):
            if self.depth == 0:
                self.ran.append(op)
            self.depth += 1
            try:
                real(g, op, env, pos)
            finally:
                self.depth -= 1

        lane._step = step


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("held", [False, True], ids=["fused", "every-rule-held"])
def test_cpu_executes_what_explain_prints(paths, model: str, held: bool) -> None:
    from fuselane.lanes.cpu.shim import CpuShim

    names = tuple(rule_names(CpuShim())) if held else ()
    runs = {
        ("decode", 1): lambda lane: lane.forward(np.array([5]), 0),
        ("prefill", PREFILL_ROWS): lambda lane: lane.forward(np.arange(PREFILL_ROWS), 0),
        ("batch", BATCH_ROWS): lambda lane: lane.forward_batch(np.arange(BATCH_ROWS), np.arange(BATCH_ROWS)),
    }
    for (form, rows), run in runs.items():
        lane = load(paths[model], lane="cpu", ctx=CTX, held=names).lane  # a batch's caches are shaped its own way
        counted = _Counted(lane)
        run(lane)
        ran = [(op, 0 if isinstance(op.sym, VIEWS) else 1) for op in counted.ran]
        _, _, told = build_plan(paths[model], lane="cpu", form=form, rows=rows, held=names)
        assert len(counted.ran) == len(told.ops)
        assert sum(n for _, n in ran) == told.launches()
        assert per_layer(ran) == launches_per_layer(told)


def test_explain_counts_the_quantizing_launches_it_adds(paths) -> None:
    # fuse_quant=off: each activation a product reads in int8 is quantized by one launch of its own, counted; the
    # quantizing folds of fuse_quant=on each run in their producer's one launch
    path = paths["qwen2-q8_0"]
    on = build_plan(path, lane="cuda", knobs=("fuse_quant=on",))[2]
    off = build_plan(path, lane="cuda", knobs=("fuse_quant=off",))[2]
    assert quantizes(off) > quantizes(on)
    assert off.launches() - quantizes(off) == on.launches() - quantizes(on)
    shim = CudaShim(CudaKnobs(fuse_quant=False))
    read = {op.ins[0] for op in off.ops if shim.activation(op, 0, off.graph) is not None}
    assert quantizes(off) == len(read)


def quantizes(plan) -> int:
    return sum(isinstance(op.sym, Quantize) for op in plan.ops)


def test_the_int8_gemv_facts_are_the_kernels() -> None:
    # the plan side decides from `kernels` what the int8 GEMV takes and how many rows a program of it turns
    from fuselane.lanes.cuda.plan import kernels
    from fuselane.lanes.cuda.triton.gemv import q8, q8_tiles

    assert q8.FORMATS == kernels.INT8_GEMV_FORMATS
    for fmt in q8.FORMATS:
        rows = kernels.INT8_GEMV_TILE_ROWS[fmt]
        tables = (q8_tiles.TILES, q8_tiles.TALL_TILES, q8_tiles.SHORT_TILES, q8_tiles.NARROW_TALL_TILES)
        assert max(t[fmt][0] for t in tables) == rows and all(rows % t[fmt][0] == 0 for t in tables), fmt
        for k in (256, 512, 4096, 12288):
            assert q8.supports(fmt, 1, k) == kernels.int8_gemv(fmt, 1, k)
        assert not kernels.int8_gemv(fmt, 2, 4096) and not q8.supports(fmt, 2, 4096)


def test_the_fast_gemv_facts_are_the_kernels() -> None:
    # the plan lets a projection's epilogue norm any width where the bound kernel walks the row in chunks
    from fuselane.lanes.cuda.plan import kernels
    from fuselane.lanes.cuda.triton.gemv import fast, fast_norm, formats

    assert set(fast.GROUPS) == kernels.FAST_GEMV_FORMATS
    assert set(formats.SLOTS) == kernels.ROWS_GEMV_FORMATS | kernels.VALUE_GEMV_FORMATS
    assert not kernels.ROWS_GEMV_FORMATS & kernels.VALUE_GEMV_FORMATS
    for fmt in kernels.FAST_GEMV_FORMATS:
        assert fast_norm.supports_fast_add_norm(fmt, 5120) and kernels.norm_walked_in_chunks(fmt, 1, 5120, 5120, False)


@pytest.mark.parametrize("shape", ["qwen2.5-0.5b:q4_k_m_05b", "qwen2.5-7b:q4_k_m", "qwen3-8b:q4_k_m"])
@pytest.mark.parametrize("prefill", ["in-place", "int8"])
def test_a_wide_chunk_splits_every_layers_gated_pair(shape: str, prefill: str) -> None:
    # the settling pass runs over a schedule that grows as it splits: every layer's pair, the last ones too, must
    # reach the GEMMs (the binder refuses a pair past the GEMV's rows rather than run it a row at a time)
    from fuselane.lanes.cuda.plan import kernels

    knobs = (f"prefill={prefill}",)
    _, cfg, plan = build_plan(f"synth:{shape}", lane="cuda", form="prefill", rows=256, knobs=knobs)
    pairs = [op for op in plan.ops if class_of(op) is C.GEMV_GATE_UP_GLU]
    assert not pairs, [op.out for op in pairs]
    glus = [op for op in plan.ops if class_of(op) is C.GLU_ACT_MUL or class_of(op) is C.GLU_ACT_MUL_QUANT]
    assert len(glus) == cfg.n_layers and kernels.GEMV_ROWS < 256


@pytest.mark.parametrize("prefill", ["f16-copy", "f16-scratch"])
def test_a_wide_chunk_keeps_its_pairs_whole_on_cublas(prefill: str) -> None:
    # the f16 knobs multiply a chunk's pair on cuBLAS: one rounding of the activation and the GLU in the
    # products' epilogue, so no layer's pair splits (a batch's still does: `test_cuda_batch_plan`)
    _, cfg, plan = build_plan(
        "synth:qwen2.5-7b:q4_k_m", lane="cuda", form="prefill", rows=256, knobs=(f"prefill={prefill}",)
    )
    pairs = [op for op in plan.ops if class_of(op) is C.GEMV_GATE_UP_GLU]
    assert len(pairs) == cfg.n_layers
    assert not [op for op in plan.ops if class_of(op) in (C.GLU_ACT_MUL, C.GLU_ACT_MUL_QUANT)]
