"""deepseek2 on the cuda lane's plan side, the synthetic shapes, and hostile files.

`latent_expanded` takes a wide chunk's absorbed latent attention whole as `Mla`, where its expanded launches
fit, counted as their three launches; the lane refuses grouped top-k with a reason: `run --lane cuda` on a
grouped file says so in one line. Every reason the rule gives has its row.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fuselane.errors import ModelError
from fuselane.explain import build_plan
from fuselane.fuse.optimizer import launches_of, optimize
from fuselane.fuse.shim import SupportKind
from fuselane.fuse.views import class_of
from fuselane.gguf.reader import open_gguf
from fuselane.gguf.synth import SHAPES, tensor_formats, write_synthetic
from fuselane.gguf.synth_latent import LatentShape, parameters
from fuselane.graph.classes import ClassId as C
from fuselane.lanes.cuda.plan import latent
from fuselane.lanes.cuda.plan.fits import TABLE_ROTATIONS_APART
from fuselane.lanes.cuda.plan.knobs import CudaKnobs
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.models import config_of
from tests.bounded import assert_one_line_error, run_bounded

WIDE = "16"  # rows past the GEMV's: the rule's chunks


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("latent_plan")
    shapes = {
        "v2": SHAPES["tiny-deepseek2"],
        "v3": SHAPES["tiny-deepseek3"],
        "half": replace(SHAPES["tiny-deepseek2"], kv_lora=48),  # the latent not whole 32-value blocks
        "attend": replace(SHAPES["tiny-deepseek2"], rope=8),  # a head's key 24 wide: not whole 16s
        "scaled": replace(SHAPES["tiny-deepseek2"], weights_scale=2.5),  # V2's routing, its weights scaled
    }
    return {k: str(write_synthetic(d / f"{k}.gguf", s, "f32")) for k, s in shapes.items()}


def latent_misses(path: str, *knobs: str, rows: str = WIDE) -> list[tuple[str, str]]:
    _, _, plan = build_plan(path, lane="cuda", form="prefill", rows=int(rows), knobs=knobs)
    return [(m.kind, m.reason) for m in plan.missed if m.rule == latent.RULE]


def test_the_rule_takes_each_layers_latent_attention_as_its_three_launches(files):
    assert latent_misses(files["v2"]) == []
    _, _, plan = build_plan(files["v2"], lane="cuda", form="prefill", rows=int(WIDE))
    assert plan.cannot_run is None
    taken = [op for op in plan.ops if class_of(op) is C.MLA]
    assert len(taken) == 2 and [f.rule for f in plan.fired].count(latent.RULE) == 2  # one a layer
    assert all(launches_of(op) == latent.LAUNCHES == 3 for op in taken)
    _, _, held = build_plan(files["v2"], lane="cuda", form="prefill", rows=int(WIDE), held=(latent.RULE,))
    # absorbed: the absorption with the query's rotation beside it and the cache row's join (MlaPrologue), the
    # attention, the value half (the slices are views); expanded, the query's rotation and the cache row's join
    # are a launch each before `Mla`'s three
    absorbed, expanded = 3, latent.LAUNCHES + 2
    assert held.launches() - plan.launches() == 2 * (absorbed - expanded)
    # with the join inside `Mla`, the query's and the key's rotations meet: the table kernel turns each apart
    rotations = {(m.kind, m.reason) for m in plan.missed if m.rule == "rope_q_k_one_launch"}
    assert rotations == {("fits", TABLE_ROTATIONS_APART)}


@pytest.mark.parametrize(
    ("case", "knobs", "rows"),
    [("dequant", ("activations=dequant",), WIDE), ("narrow", (), "8"), ("batch", ("batch=on",), WIDE)],
)
def test_the_rule_stays_out_of_dequant_narrow_chunks_and_batches(files, case, knobs, rows):
    assert latent_misses(files["v2"], *knobs, rows=rows) == []


@pytest.mark.parametrize(
    ("case", "knobs", "reason"),
    [
        ("half", (), latent.HALF_NOT_IN_TILES),
        ("attend", (), latent.ATTENTION_NOT_IN_TILES),
        ("v2", ("smem=1",), latent.NO_HEAD_FITS),
    ],
)
def test_every_fits_reason_has_its_row(files, case, knobs, reason):
    assert latent_misses(files[case], *knobs) == [("fits", reason)] * 2


def test_latent_launches_size_three_launches():
    shim = CudaShim(CudaKnobs())
    lt = latent.Latent("qr", "qpp", "kc", "pos", 16, 576, 512, 128, 4096, 512, 0.1, "kb", *_formats(), "vb",
                       _formats()[0], 128, "ct")  # fmt: skip
    kh, vh, attend = latent.latent_launches(shim, lt)
    assert (kh.a, kh.b, kh.rows_out, vh.a, vh.b, vh.rows_out) == (512, 128, False, 512, 128, True)
    assert kh.upto == vh.upto == ("pos", 511) and kh.x == vh.x == "kc" and kh.pitch == 576
    assert (attend.hd, attend.vd, attend.own, attend.q_tail, attend.k_tail) == (192, 128, 128, ("qpp", 64),
                                                                               ("kc", 576, 512))  # fmt: skip
    assert attend.per_block >= 1 and 16 % attend.per_block == 0
    assert latent.why_not(shim, lt) is None


def _formats():
    from fuselane.gguf.formats import Format

    return Format.Q8_0, True


def test_the_shim_answers_as_specified():
    # as the specification's lane, except MlaPrologue: this lane has its launch (`triton/mla/prologue.py`)
    shim = CudaShim(CudaKnobs())
    assert shim.supports(C.GROUPED_TOPK).reason == "the lane routes by one top-k over every expert"
    for cls in (C.MLA, C.MLA_PROLOGUE):
        assert shim.supports(cls).kind is SupportKind.NATIVE
    assert shim.supports(C.MLA_UNABSORB_IN_FOLD).kind is SupportKind.DECOMPOSE


def test_run_on_the_cuda_lane_says_why_in_one_line(files):
    done, seconds = run_bounded(["run", files["v3"], "hi", "--lane", "cuda", "-n", "1"])
    line = assert_one_line_error(done, seconds)
    assert "routes by one top-k over every expert" in line and "latent" not in line


def test_deepseek_v2_lite_shape():
    shape = SHAPES["deepseek-v2-lite"]
    assert (shape.n_layers, shape.n_embd, shape.n_heads, shape.q_lora, shape.kv_lora) == (27, 2048, 16, 0, 512)
    assert (shape.nope, shape.rope, shape.vdim, shape.dense_layers, shape.n_ff) == (128, 64, 128, 1, 10944)
    assert (shape.experts, shape.experts_used, shape.expert_ff, shape.shared_experts) == (64, 6, 1408, 2)
    assert 15.6e9 < parameters(shape) < 15.8e9  # DeepSeek-V2-Lite's 15.7B
    formats = tensor_formats(shape, "q4_k_m")
    assert formats["blk.1.ffn_gate_inp.weight"].name == "F32"
    _, cfg, plan = build_plan("synth:deepseek-v2-lite", lane="cpu", form="decode")
    assert cfg.cache_values == 576 and cfg.latent.q_lora == 0 and plan.ops


def _cfg_with(path: str, **changes):
    f = open_gguf(path)
    meta = {**f.metadata, **changes}
    return config_of({k: v for k, v in meta.items() if v is not None}, f.tensors)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"deepseek2.attention.key_length": 99}, "attention.key_length"),
        ({"deepseek2.expert_gating_func": 7}, "expert_gating_func"),
        ({"deepseek2.expert_group_count": 3}, "expert_group_count"),
        ({"deepseek2.expert_group_used_count": 1, "deepseek2.expert_used_count": 3}, "expert_group_used_count"),
        ({"deepseek2.rope.scaling.type": "linear"}, "rope.scaling.type"),
        ({"deepseek2.attention.kv_lora_rank": None}, "kv_lora_rank"),
        ({"deepseek2.leading_dense_block_count": 9}, "leading_dense_block_count"),
        ({"deepseek2.attention.kv_lora_rank": 40}, "deepseek2.attention.key_length"),
        (
            {
                "deepseek2.attention.kv_lora_rank": 40,
                "deepseek2.attention.key_length": 56,
                "deepseek2.attention.value_length": 40,
            },
            "attn_kv_a_mqa",
        ),  # fmt: skip
        ({"deepseek2.vocab_size": 7}, "vocab_size"),
        ({"deepseek2.expert_weights_norm": 1}, "expert_weights_norm"),
    ],
)
def test_hostile_metadata_is_one_clear_line(files, changes, says):
    with pytest.raises(ModelError) as e:
        _cfg_with(files["v3"], **changes)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_latent_shape_refuses_no_routing():
    with pytest.raises(Exception, match="no routing"):
        LatentShape(64, 2, 4, 128, 512, kv_lora=32, nope=16, rope=16, vdim=16, experts=8, experts_used=9)


def test_grouped_routing_fuses_on_the_cpu_lane_and_the_cuda_lane_declines_it(files):
    _, _, cpu = build_plan(files["v3"], lane="cpu", form="decode")
    assert [f.rule for f in cpu.fired].count("grouped_topk") == 1  # the one mixture layer
    _, _, cuda = build_plan(files["v3"], lane="cuda", form="prefill", rows=int(WIDE))
    declined = {(m.kind, m.reason) for m in cuda.missed if m.rule == "grouped_topk"}
    assert declined == {("refuse", "the lane routes by one top-k over every expert")}
    _, _, plain = build_plan(files["v2"], lane="cpu", form="decode")  # V2 routes by one top-k: the mixture's rule
    assert "grouped_topk" not in {f.rule for f in plain.fired} and "router_topk" in {f.rule for f in plain.fired}


def test_the_cuda_routing_kernel_takes_scaled_and_sigmoid_weights(files, tmp_path):
    _, _, scaled = build_plan(files["scaled"], lane="cuda", form="decode")
    assert "router_topk" in {f.rule for f in scaled.fired}
    _, _, plain = build_plan(files["v2"], lane="cuda", form="decode")
    assert "router_topk" in {f.rule for f in plain.fired}
    ungrouped = replace(SHAPES["tiny-deepseek3"], groups=1, groups_used=1, q_lora=64)  # sigmoid, bias, scale, renorm
    _, _, v3 = build_plan(str(write_synthetic(tmp_path / "u.gguf", ungrouped, "f32")), lane="cuda", form="decode")
    assert "router_topk" in {f.rule for f in v3.fired} and v3.cannot_run is None


def test_info_and_bench_print_the_cache_a_token(files, capsys):
    from fuselane.bench import BenchResult, render
    from fuselane.cli import main

    assert main(["info", files["v3"]]) == 0
    out = capsys.readouterr().out
    assert "cache         48 values a token a layer (kv_lora_rank 32 + rope 16), 96 over 2 layers" in out
    assert "latent        q LoRA 48, kv_lora_rank 32" in out and "top 2 of 4 groups" in out
    result = BenchResult("m.gguf", "cpu:float32", 0.0, 16, 8, 0, 1.0, 1.0, None, 0.0, 1.0, 1.0, 100.0, None,
                         cache_values="48 values a token a layer")  # fmt: skip
    assert render([result]).endswith("m.gguf: cache 48 values a token a layer")


def test_explain_says_why_the_cuda_lane_cannot_run_it(files, capsys):
    import json

    from fuselane.cli import main

    assert main(["explain", files["v3"], "--lane", "cuda", "--json"]) == 0
    why = json.loads(capsys.readouterr().out)["cannot_run"]
    assert "one top-k over every expert" in why and "latent" not in why
    assert main(["explain", files["v3"], "--lane", "cpu", "--json"]) == 0
    assert "cannot_run" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("knobs", [(), ("activations=dequant",)])
def test_a_decode_step_folds_the_shared_experts_into_the_mixtures_launches(files, knobs):
    # DeepSeek's shared experts add to the mixture ungated: their SwiGLU rides the kept experts' gate/up launch
    # and their down rows the down launch, as a gated one's do (`moe/shared.py`): two launches a mixture layer
    # fewer than apart (`shared_fold=off`)
    from tests.lanes.test_cuda_launches import folded

    _, _, plan = build_plan(files["v2"], lane="cuda", form="decode", knobs=knobs)
    _, _, apart = build_plan(files["v2"], lane="cuda", form="decode", knobs=(*knobs, "shared_fold=off"))
    assert folded(plan, C.SHARED_EXPERT_FUSION) == 1 and folded(apart, C.SHARED_EXPERT_FUSION) == 0
    assert not {"l1.sh_glu", "l1.sh_down"} & {op.out for op in plan.ops}
    assert apart.launches() - plan.launches() == 2  # the file's one mixture layer


def _joins(plan) -> list:
    """The plan's ops, with each MlaPrologue's two joins in its place."""
    return [part for op in plan.ops for part in (op.sym.parts if class_of(op) is C.MLA_PROLOGUE else (op,))]


@pytest.mark.parametrize("form, rows", [("decode", 1), ("prefill", 8), ("prefill", int(WIDE))])
def test_the_cache_rows_join_is_written_in_the_cache(files, form, rows):
    # `join_row_write`: the cache row's join (the normed latent, the rotated key) lands in the latent cache at the
    # position, so no row write follows it: a launch a layer less; the query's join keeps its buffer
    from fuselane.graph.ops import SetRow

    _, _, plan = build_plan(files["v2"], lane="cuda", form=form, rows=rows)
    _, _, held = build_plan(files["v2"], lane="cuda", form=form, rows=rows, held=("join_row_write",))
    joins = [op for op in _joins(plan) if class_of(op) is C.JOIN_IN_PLACE]
    in_cache = [op for op in joins if op.dst.row is not None]
    assert len(in_cache) == 2 and {op.dst.buf for op in in_cache} == {"blk.0.latent_cache", "blk.1.latent_cache"}
    assert all(isinstance(op.sym.parts[-1].sym, SetRow) for op in in_cache)
    assert [f.rule for f in plan.fired].count("join_row_write") == 2
    assert not any(isinstance(op.sym, SetRow) and op.dst.buf.endswith("latent_cache") for op in plan.ops)
    assert held.launches() - plan.launches() == 2  # one a layer


def test_a_batchs_cache_rows_keep_their_row_write(files):
    # a batch's rows land at their own positions (`SetRow.batched`): the join keeps its buffer, the lane says why
    from fuselane.lanes.cuda.plan.fits import JOIN_ROW_WRITE_FORM

    _, _, plan = build_plan(files["v2"], lane="cuda", form="batch", rows=4)
    assert "join_row_write" not in {f.rule for f in plan.fired}
    assert {(m.kind, m.reason) for m in plan.missed if m.rule == "join_row_write"} == {("fits", JOIN_ROW_WRITE_FORM)}


@pytest.mark.parametrize(("vdim", "folded"), [(32, True), (16, False)])
def test_the_value_half_writes_the_int8_form_attn_output_reads(tmp_path, vdim, folded):
    # `gemv_quant` on the per-head product: heads of whole 32-value blocks write their int8 form in its programs
    # (a launch a layer less than a Quantize after it); narrower heads keep the Quantize, and the lane says why
    from fuselane.graph.ops import HeadMatmul, Quantize
    from fuselane.lanes.cuda.plan.fits import HEADS_IN_BLOCKS

    path = str(write_synthetic(tmp_path / "m.gguf", replace(SHAPES["tiny-deepseek2"], vdim=vdim), "q8_0"))
    _, _, plan = build_plan(path, lane="cuda", form="decode")
    _, _, held = build_plan(path, lane="cuda", form="decode", held=("gemv_quant",))
    values = [op for op in plan.ops if class_of(op) is C.GEMV_QUANT and isinstance(op.sym.parts[0].sym, HeadMatmul)]
    apart = [op for op in plan.ops if isinstance(op.sym, Quantize) and op.out.endswith(".attn")]
    assert (len(values), len(apart)) == ((2, 0) if folded else (0, 2))
    assert held.launches() - plan.launches() == (2 if folded else 0)
    misses = [m for m in plan.missed if m.rule == "gemv_quant" and (m.kind, m.reason) == ("fits", HEADS_IN_BLOCKS)]
    assert len(misses) == (0 if folded else 2)


@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0", "q2_k"])
def test_a_v2_lite_decode_step_joins_in_one_launch(mix):
    # `mla_prologue`: the query's join and the cache row's share one launch, a launch a layer fewer (9 -> 8 on a
    # mixture layer: the projection, the prologue, the attention, the value half, the output projection with
    # the norm, the routing, the experts' gate/up, their down with the next norm); with the routing in the
    # output projection's launch (knob route_in_norm=on), 7
    from fuselane.explain import launches_per_layer
    from fuselane.gguf.synth import Mix
    from tests.lanes.test_launch_budget import _decode_graph

    g, _ = _decode_graph(replace(SHAPES["deepseek-v2-lite"], n_layers=3), "deepseek-v2-lite", Mix(mix))
    plan = optimize(g, CudaShim(CudaKnobs()))
    held = optimize(g, CudaShim(CudaKnobs()), held=("mla_prologue",))
    assert [class_of(op) for op in plan.ops].count(C.MLA_PROLOGUE) == 3
    per_layer, apart = launches_per_layer(plan), launches_per_layer(held)
    assert [apart[i] - per_layer[i] for i in range(3)] == [1, 1, 1]
    assert max(per_layer.values()) == 8
    routed = optimize(g, CudaShim(CudaKnobs(route_in_norm=True)))
    assert max(launches_per_layer(routed).values()) == 7
