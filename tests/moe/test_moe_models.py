"""Mixture checkpoints end to end, without transformers: synthetic files at the built-in shapes, what `info` and
`explain` say of them, where the classes stand (`STANDING` against what fires on the mixtures' plans), and the
cuda lane's answers and launches for a mixture."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from fuselane.errors import FuselaneError
from fuselane.explain import FORMS, build_plan
from fuselane.fuse.shim import SupportKind
from fuselane.fuse.views import class_of
from fuselane.gguf.formats import Format
from fuselane.gguf.reader import open_gguf
from fuselane.gguf.synth import SHAPES, Shape, tensor_formats, tensor_shapes, write_synthetic
from fuselane.graph.classes import ClassId, built_by
from fuselane.info import describe
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.models import config_of
from fuselane.runtime.model import load
from tests.bounded import run_bounded
from tests.graph.test_classes import MIXTURE_RULES

MOE_MODELS = ("synth:tiny-qwen2moe", "synth:tiny-qwen3moe", "synth:tiny-qwen3moe:q4_k_m")
CPU_LANES = (("cpu", ()), ("cpu", ("dtype=f64",)))
# Parameters of the real checkpoints (their model cards): 30.5B and 14.3B.
REAL_PARAMETERS = {"qwen3-30b-a3b": 30.5e9, "qwen1.5-moe-a2.7b": 14.3e9}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_models")
    return {
        name: write_synthetic(d / f"{name}.gguf", name, "q4_k_m", seed=2) for name in ("tiny-qwen2moe", "tiny-qwen3moe")
    }


@pytest.mark.parametrize("name", REAL_PARAMETERS)
def test_the_built_in_shapes_are_the_real_models(name):
    shape = SHAPES[name]
    params = sum(int(np.prod(dims)) for dims in tensor_shapes(shape).values())
    assert abs(params - REAL_PARAMETERS[name]) / REAL_PARAMETERS[name] < 0.01
    b = "blk.0."
    dims = tensor_shapes(shape)
    assert dims[b + "ffn_gate_exps.weight"] == (shape.experts, shape.expert_ff, shape.n_embd)
    assert dims[b + "ffn_down_exps.weight"] == (shape.experts, shape.n_embd, shape.expert_ff)
    assert tensor_formats(shape, "q4_k_m")[b + "ffn_gate_inp.weight"] is Format.F32  # llama.cpp keeps routers F32
    assert (b + "ffn_up_shexp.weight" in dims) == (shape.arch == "qwen2moe")


def test_a_synthetic_mixture_reads_back_as_written(tiny):
    with open_gguf(tiny["tiny-qwen2moe"]) as f:
        cfg = config_of(f.metadata, f.tensors)
        assert f.tensors["blk.1.ffn_up_exps.weight"].shape == (8, 32, 64)
    assert (cfg.arch, cfg.experts, cfg.experts_used, cfg.expert_ff, cfg.shared_ff, cfg.renorm) == (
        "qwen2moe",
        8,
        2,
        32,
        64,
        False,
    )


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (dict(experts=0, experts_used=2, expert_ff=32), "experts must be positive"),
        (dict(experts=4, experts_used=5, expert_ff=32), "more than the 4 experts"),
        (dict(experts=4, experts_used=2, expert_ff=32, shared_ff=64), "qwen3moe has none"),
    ],
)
def test_a_bad_mixture_shape_is_refused(fields, says):
    with pytest.raises(FuselaneError, match=says):
        Shape("qwen3moe", 64, 2, 4, 2, 16, 128, 512, **fields)


def test_info_shows_the_experts_and_their_widths(tiny):
    facts = describe(str(tiny["tiny-qwen2moe"]))
    assert facts["experts"] == {"count": 8, "used": 2, "ffn": 32, "shared_ffn": 64, "renormalised": False}
    assert describe(str(tiny["tiny-qwen3moe"]))["experts"]["renormalised"] is True
    done, _ = run_bounded(["info", str(tiny["tiny-qwen2moe"])])
    assert "8 experts of ffn 32, 2 kept a token" in done.stdout.decode()
    assert "a shared expert of ffn 64" in done.stdout.decode()


def test_explain_on_the_cuda_lane_shows_a_decode_mixture_in_three_launches():
    ops = [class_of(op) for op in build_plan("synth:tiny-qwen3moe", lane="cuda")[2].ops]
    # the kept experts' gate/up and the mixture's last step write their results' int8 form themselves, and so
    # does the projection before the mixture (its norm read by the router in f32, by the experts in int8)
    assert ops.count(ClassId.ROUTER_TOPK) == ops.count(ClassId.GLU_ACT_MUL_QUANT) == 2  # a layer each
    assert ops.count(ClassId.NORM_QUANT) == 2 * ops.count(ClassId.ROUTER_TOPK)


def test_the_cuda_shim_runs_the_mixture_classes_and_refuses_grouped_routing():
    shim = CudaShim()
    for cls in (ClassId.ROUTER_TOPK, ClassId.MOE_GATE_UP_ACT, ClassId.MOE_DEFERRED_FINALIZE):
        assert shim.supports(cls).kind is SupportKind.NATIVE
    assert shim.supports(ClassId.GROUPED_TOPK).reason == "the lane routes by one top-k over every expert"


def test_explain_on_the_cpu_lane_shows_the_mixture_classes():
    """The top-level ops of a step's schedule (a class folded into another shows when that one is held)."""
    decode = [class_of(op) for op in build_plan("synth:tiny-qwen2moe")[2].ops]
    assert {ClassId.ROUTER_TOPK, ClassId.MOE_GATE_UP_ACT, ClassId.MOE_DEFERRED_FINALIZE} <= set(decode)
    argv = ["explain", "synth:tiny-qwen2moe", "--lane", "cpu", "--json", "--form", "prefill"]
    done, _ = run_bounded([*argv, "--hold", "moe_deferred_finalize"])
    assert done.returncode == 0, done.stderr.decode()
    shown = [op["op"] for op in json.loads(done.stdout)["schedule"]]
    assert {"MoeTokenSort", "MoeGateUpAct", "SharedExpertFusion"} <= set(shown)


@pytest.fixture(scope="module")
def plans():
    return {
        (model, form, lane, knobs): build_plan(model, lane=lane, form=form, knobs=knobs)[2]
        for model, form, (lane, knobs) in itertools.product(MOE_MODELS, FORMS, CPU_LANES)
    }


def test_what_fires_on_the_mixtures_is_what_the_record_says(plans):
    fired = set()
    for key, plan in plans.items():
        for f in plan.fired:
            assert f.rule in built_by(f.cls), f"{key}: {f.rule} built {f.cls.value}, which STANDING does not say"
            fired.add(f.rule)
        for op in plan.ops:
            assert class_of(op) is None or built_by(class_of(op)), key
    assert set(MIXTURE_RULES) <= fired


def test_a_batch_of_sequences_routes_each_as_alone(tiny):
    """A batch's rows are each one sequence's step: each is routed and multiplied as that step alone."""
    ids = np.array([3, 7, 11])
    batched = load(tiny["tiny-qwen2moe"], lane="cpu", ctx=8, dtype=np.float64)
    got = batched.lane.forward_batch(ids, np.zeros(3, dtype=np.int64))
    for row, token in enumerate(ids):
        alone = load(tiny["tiny-qwen2moe"], lane="cpu", ctx=8, dtype=np.float64)
        assert np.abs(got[row] - alone.lane.forward(np.array([token]), 0)[-1]).max() <= 1e-12
        alone.close()
    batched.close()
