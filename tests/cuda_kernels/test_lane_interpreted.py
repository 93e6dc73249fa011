"""The whole cuda lane (plan, buffers, every launch) under Triton's interpreter, against the cpu lane in f64.

This is how every commit checks that each native class the cuda shim accepts has a launch that runs and
computes the right numbers, on a machine without a GPU. Tolerances come from the lane's numerics contract.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import GPU_ONLY  # noqa: E402

from fuselane.fuse.optimizer import rule_names  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.lanes.cuda.run import stored  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

PROMPT = [5, 60, 7, 300, 8, 1, 2, 3, 4, 5, 6]  # past the GEMV's rows: the prefill GEMM and flash-prefill run
DECODE = [9, 10, 11]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _steps(model, decode: list[int] = DECODE) -> list[np.ndarray]:
    s = model.session()
    out = [s.feed(PROMPT)]
    out += [s.extend([t]) for t in decode]
    return out


def _lane_cases() -> list:
    """Each numerics x (fused or every rule held) x model. Interpreted, the Q8_0 model's int8 cases take ~5
    minutes each: CI runs the fused one, and the one with every rule held runs on the GPU (the held plan under
    int8 is checked interpreted on the f16 model)."""
    cases = []
    for activations in ("int8", "dequant"):
        for held, held_id in ((False, "fused"), (True, "every-rule-held")):
            for shape, mix in (("tiny-qwen2", "q8_0"), ("tiny-qwen3", "f16")):
                gpu_only = activations == "int8" and held and mix == "q8_0"
                marks = GPU_ONLY if gpu_only else ()
                name = f"{activations}-{held_id}-{shape}-{mix}"
                cases.append(pytest.param(shape, mix, held, activations, marks=marks, id=name))
    return cases


@pytest.mark.parametrize(("shape", "mix", "held", "activations"), _lane_cases())
def test_cuda_lane_matches_cpu_f64(tmp_path, shape, mix, held, activations):
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, seed=4)
    knobs = [f"activations={activations}"]
    gpu = load(path, lane="cuda", ctx=32, knobs=knobs)
    if held:
        gpu = load(path, lane="cuda", ctx=32, held=rule_names(gpu.lane.shim), knobs=knobs)
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    for step, (a, b) in enumerate(zip(_steps(gpu), _steps(ref), strict=True)):
        assert np.isfinite(a).all()
        assert rel(a, b) <= tol, f"step {step}: {rel(a, b):.2e} > {tol:.2e}"


def test_prefill_in_place_decodes_the_weights_in_the_kernel(tmp_path, monkeypatch):
    # rows of 128 values under prefill=in-place: every prefill product takes the in-kernel-dequantizing GEMM,
    # none an f16 copy
    from fuselane.gguf.synth import Shape
    from fuselane.lanes.cuda.triton import gemm

    calls: list[int] = []
    real = gemm.gemm
    monkeypatch.setattr(gemm, "gemm", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    shape = Shape("qwen2", 128, 1, 4, 2, 32, 256, 512, context=4096)
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=6)
    gpu = load(path, lane="cuda", ctx=32, knobs=["prefill=in-place"])
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    a, b = gpu.session().feed(PROMPT), ref.session().feed(PROMPT)
    assert np.isfinite(a).all() and rel(a, b) <= tol
    assert calls, "no prefill product took the GEMM"
    assert not any(n != "token_embd.weight" for n in gpu.lane._dense), "a product made an f16 copy"


INT8_SHAPES = {  # heads of whole 32-value blocks (attention quantizes its output), Q5_0 / Q8_0 and Q4_K / Q6_K rows
    "qwen2": (("qwen2", 128, 2, 4, 2, 32, 256, 512), "q8_0"),
    # the qwen3's down projection is longer than twice its width: under norm_launch=on its add and norm take a
    # launch of their own
    "qwen3": (("qwen3", 256, 1, 4, 2, 64, 768, 512), "q4_k_m"),
}


def _int8_within_contract(path, knobs: list[str], steps: int):
    """The cuda lane at `knobs` on `path`: its logits over the first `steps` decode steps are finite and
    within its contract of the cpu lane's in f64. Returns the cuda model."""
    gpu = load(path, lane="cuda", ctx=32, knobs=knobs)
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    for step, (a, b) in enumerate(zip(_steps(gpu, DECODE[:steps]), _steps(ref, DECODE[:steps]), strict=True)):
        assert np.isfinite(a).all()
        assert rel(a, b) <= tol, f"step {step}: {rel(a, b):.2e} > {tol:.2e}"
    return gpu


@pytest.mark.parametrize("arch", INT8_SHAPES)
def test_int8_activations_multiply_with_dp4a(tmp_path, monkeypatch, arch):
    # activations=int8: a decode step's products read int8 codes written by their producers' epilogues (the
    # add + norm's last program, SwiGLU's, attention's) and multiply with dp4a; within the int8 contract
    from fuselane.gguf.synth import Shape, tensor_formats
    from fuselane.lanes.cuda.plan import kernels
    from fuselane.lanes.cuda.triton import norm, quant
    from fuselane.lanes.cuda.triton.gemv import q8 as gemv_q8
    from fuselane.lanes.cuda.triton.gemv import q8_epilogue as gemv_q8_epilogue
    from fuselane.lanes.cuda.triton.gemv import q8_rope as gemv_q8_rope

    dims, mix = INT8_SHAPES[arch]
    shape = Shape(*dims, context=4096)

    calls: dict[str, int] = {}

    def counted(module, name, key=None, when=lambda kwargs: True):
        real, key = getattr(module, name), key or name
        monkeypatch.setattr(
            module, name, lambda *a, **k: calls.update({key: calls.get(key, 0) + when(k)}) or real(*a, **k)
        )

    for module, name in ((gemv_q8, "gemv_q8_parts"), (gemv_q8_epilogue, "gemv_q8_add_norm")):
        counted(module, name)
    counted(gemv_q8_epilogue, "gemv_q8_gate_up_glu_q8")
    counted(quant, "quantize")
    # a decode step's norms (a chunk's add + norms quantize for the int8 GEMM too)
    counted(norm, "rms_norm", "norm_q8", lambda k: k.get("out_q8") is not None and k["out_q8"].q.shape[0] == 1)
    counted(gemv_q8_rope, "gemv_q8_parts_rope")
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, seed=8)
    # two decode steps: the interpreter takes minutes a step at these widths
    gpu = _int8_within_contract(path, ["activations=int8", "norm_launch=on", "rope_epilogue=on"], steps=2)
    assert calls.get("gemv_q8_add_norm") and calls.get("gemv_q8_gate_up_glu_q8") and calls.get("gemv_q8_parts"), calls
    # rope_epilogue=on: each layer's query and key turn in the QKV GEMV's epilogue, a launch less a layer
    assert calls.get("gemv_q8_parts_rope"), calls
    # one quantizing launch a step (the embedding's norm): the rest quantize in their producers' epilogues; under
    # norm_launch=on a down projection longer than twice the width leaves its add and norm (quantizing) to a
    # launch of its own
    own = kernels.norm_in_own_launch(kernels.Mode.INT8, shape.n_ff, shape.n_embd)
    assert bool(calls.get("norm_q8")) == own, calls
    # against the f32 GEMVs turning the same heads in their epilogue (`f32_rope`): the int8 step's one launch more
    # is the embedding's norm quantizing, and under norm_launch a down projection's add + norm. A layer whose
    # value rows are in another format (the Q4_K_M recipe's Q6_K attn_v) takes them into its GEMV in parts under
    # both numerics (two formats in one launch: the int8 GEMV, the f32 GEMV by rows)
    formats = tensor_formats(shape, mix)
    mixed = sum(formats[f"blk.{i}.attn_v.weight"] != formats[f"blk.{i}.attn_q.weight"] for i in range(shape.n_layers))
    assert mix != "q4_k_m" or mixed  # the Q4_K_M layer's Q6_K value rows ran in the two formats' launch above
    plain = load(path, lane="cuda", ctx=32, knobs=["activations=dequant", "rope_epilogue=on"])
    assert gpu.lane.step(1).launches == plain.lane.step(1).launches + 1 + own * shape.n_layers


def test_rope_epilogue_auto_turns_only_the_layers_that_need_it(tmp_path):
    # a 2-layer Q4_K_M qwen3: layer 1's attn_v is Q6_K (use_more_bits). Under auto its QKV GEMV has the query and
    # the key alone, turning them in its epilogue, and the V a launch of its own; layer 0's V shares its GEMV, its
    # rotations a launch after it. Under off and on layer 1's V joins its GEMV as a second format (the int8
    # GEMV's parts take two), so off runs each layer's rotations after its GEMV at no launch more than auto, and
    # on turns every layer's in the GEMV
    from fuselane.gguf.synth import Shape
    from fuselane.lanes.cuda.plan.knobs import CudaKnobs, RopeEpilogue

    shape = Shape("qwen3", 256, 2, 4, 2, 64, 768, 512, context=4096)
    path = write_synthetic(tmp_path / "m.gguf", shape, "q4_k_m", seed=8)

    def launches(*knobs: str) -> int:
        return load(path, lane="cuda", ctx=32, knobs=["activations=int8", *knobs]).lane.step(1).launches

    off, auto, on = (launches(f"rope_epilogue={v}") for v in ("off", "auto", "on"))
    assert (auto, on) == (off, off - 2)
    assert CudaKnobs().rope_epilogue is RopeEpilogue.AUTO and launches() == auto
    # without norm_launch auto turns none
    assert launches("norm_launch=off") == launches("norm_launch=off", "rope_epilogue=off")


def test_dequant_turns_the_query_and_key_in_the_f32_gemvs_epilogue(tmp_path, monkeypatch):
    # activations=dequant: layer 1's query and key (its Q6_K attn_v a launch of its own) turn in the f32 QKV
    # GEMV's epilogue (`f32_rope`) under rope_epilogue=auto, every layer's under on; within the f32 contract. As
    # under int8 activations, off and on take layer 1's value rows into its GEMV as a second format (the f32 GEMV
    # by rows takes two), so auto turns its heads at no launch fewer than off
    from fuselane.gguf.synth import Shape
    from fuselane.lanes.cuda.triton.gemv import f32_rope

    # a feed-forward of one super-block a row: its interpreted f32 gate/up pair is most of the test's time
    shape = Shape("qwen3", 256, 2, 4, 2, 64, 256, 512, context=4096)
    path = write_synthetic(tmp_path / "m.gguf", shape, "q4_k_m", seed=8)
    calls: list[int] = []
    real = f32_rope.gemv_f32_parts_rope
    monkeypatch.setattr(f32_rope, "gemv_f32_parts_rope", lambda *a, **k: calls.append(1) or real(*a, **k))

    def launches(*knobs: str) -> int:
        return load(path, lane="cuda", ctx=32, knobs=["activations=dequant", *knobs]).lane.step(1).launches

    off, auto, on = (launches(f"rope_epilogue={v}") for v in ("off", "auto", "on"))
    assert (auto, on) == (off, off - 2)
    calls.clear()
    _int8_within_contract(path, ["activations=dequant", "rope_epilogue=on"], steps=1)
    assert calls  # the step's two layers turned their heads in the f32 GEMV
    # off: layer 1's Q4_K query and key and its Q6_K value rows in one launch of the GEMV by rows, unturned
    from fuselane.lanes.cuda.triton.gemv import rows

    calls.clear()
    plain, mixed = rows.gemv_parts, []
    monkeypatch.setattr(rows, "gemv_parts", lambda x, p, fmt, **k: mixed.append(fmt) or plain(x, p, fmt, **k))
    _int8_within_contract(path, ["activations=dequant", "rope_epilogue=off"], steps=1)
    assert [f for f in mixed if isinstance(f, list) and len(set(f)) == 2] and not calls


def test_int8_products_quantize_what_their_producer_did_not(tmp_path):
    # fuse_quant=off: producers write f32 and every product that reads int8 quantizes its activation in a
    # launch of its own before it, one more launch a product; the numbers stay within the int8 contract
    from fuselane.gguf.synth import Shape

    dims, mix = INT8_SHAPES["qwen2"]
    path = write_synthetic(tmp_path / "m.gguf", Shape(*dims, context=4096), mix, seed=9)
    gpu = _int8_within_contract(path, ["activations=int8", "fuse_quant=off"], steps=1)
    step = gpu.lane.step(1)
    reading = [op for op in step.plan.ops if gpu.lane.shim.activation(op, 0, step.plan.graph) is not None]
    plain = load(path, lane="cuda", ctx=32, knobs=["activations=dequant"])
    assert reading and step.launches == plain.lane.step(1).launches + len(reading)


@pytest.mark.parametrize(
    ("knob", "module", "launcher", "seed"),
    [("int8", "gemm_q8", "gemm_q8", 6), ("in-place", "gemm_sb", "product", 7)],
    ids=["int8-tensor-cores", "in-place-super-blocks"],
)
def test_prefill_from_the_files_bytes(tmp_path, monkeypatch, knob, module, launcher, seed):
    # a Q4_K_M checkpoint under prefill=int8 (the activation's int8 form times the checkpoint's bytes, `gemm_q8`)
    # or prefill=in-place (the super-block f16 GEMM, `gemm_sb`): every chunk product (Q4_K and Q6_K rows) takes
    # that kernel, no f16 copy of any matrix is made, and the logits keep the contract against the cpu lane in f64
    import importlib

    from fuselane.gguf.synth import Shape

    kernels = importlib.import_module(f"fuselane.lanes.cuda.triton.{module}")
    formats: set[int] = set()
    real = getattr(kernels, launcher)
    monkeypatch.setattr(kernels, launcher, lambda *a, **k: formats.add(int(a[2])) or real(*a, **k))
    path = write_synthetic(tmp_path / "m.gguf", Shape(*INT8_SHAPES["qwen3"][0], context=4096), "q4_k_m", seed=seed)
    gpu = load(path, lane="cuda", ctx=32, knobs=[f"prefill={knob}"])
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    a, b = gpu.session().feed(PROMPT), ref.session().feed(PROMPT)
    assert np.isfinite(a).all() and rel(a, b) <= tol, f"{rel(a, b):.2e} > {tol:.2e}"
    assert formats == {12, 14}, formats  # Q4_K, Q6_K
    assert not gpu.lane._dense, "a product made an f16 copy"


@pytest.mark.parametrize("shape", ["tiny-qwen2", "tiny-qwen3"])
def test_a_yarn_model_runs_as_the_cpu_lane(tmp_path, shape):
    # `rope.scaling.type` yarn: the fused NEOX rotations turn by the stretched frequencies and the scores take
    # YaRN's scale
    from dataclasses import replace

    from fuselane.fuse.views import class_of
    from fuselane.gguf.synth import SHAPES
    from fuselane.graph.classes import ClassId as C

    yarn = replace(SHAPES[shape], yarn_factor=4.0, yarn_original=16)
    path = write_synthetic(tmp_path / "m.gguf", yarn, "f16", seed=4)
    gpu = load(path, lane="cuda", ctx=32, knobs=["activations=dequant"])
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    assert gpu.cfg.yarn is not None
    fused = {C.QK_NORM_ROPE, C.QK_NORM_ROPE_KV_APPEND, C.ROPE_KV_APPEND, C.ROPE_QK_ONE_LAUNCH}
    assert fused & {class_of(op) for op, _ in gpu.lane.step(1).bound}
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    for step, (a, b) in enumerate(zip(_steps(gpu), _steps(ref), strict=True)):
        assert np.isfinite(a).all()
        assert rel(a, b) <= tol, f"step {step}: {rel(a, b):.2e} > {tol:.2e}"


@pytest.mark.parametrize("heads", [4, 6], ids=["group-of-2", "group-of-3"])
def test_heads_of_no_power_of_two_run_as_the_cpu_lane(tmp_path, heads):
    # heads of 48 values: the prefill attention pads a head to a power of two in its tile, the decode's
    # too; a head is no whole 32-value blocks, so a decode block of an even group takes two heads (three
    # blocks) and one of an odd group one head, writing the blocks it holds whole, the later of two blocks the
    # one they share (AttnOutputQuant); a chunk's attention leaves its int8 form to a Quantize launch
    from fuselane.fuse.views import class_of
    from fuselane.gguf.synth import Shape
    from fuselane.graph.classes import ClassId as C
    from tests.lane_steps import runs_as_the_cpu_lane

    shape = Shape("qwen3", 160, 1, heads, 2, 48, 256, 512, context=4096)
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=4)
    step = load(path, lane="cuda", ctx=32).lane.step(1)
    assert C.ATTN_OUTPUT_QUANT in {class_of(op) for op, _ in step.bound}
    runs_as_the_cpu_lane(path, PROMPT, [12, 13], DECODE, ctx=32)


def test_the_weights_are_parts_of_one_upload_holding_the_files_bytes(tmp_path):
    # one device buffer for every tensor (a block each took what the caching allocator rounds it to): each
    # matrix its file bytes at an aligned offset, each vector its f32 values, no two overlapping
    from fuselane.gguf.dequant import dequantize
    from fuselane.lanes.cuda.plan.kernels import PART_ALIGN_BYTES

    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "q4_k_m", seed=4)
    lane = load(path, lane="cuda", ctx=32).lane
    base = next(iter(lane.raw.values()))[0].untyped_storage().data_ptr()
    spans = []
    for name, (raw, _) in lane.raw.items():
        t = lane.tensors[name]
        assert raw.untyped_storage().data_ptr() == base, name
        start = raw.data_ptr() - base
        assert start % PART_ALIGN_BYTES == 0, name
        spans.append((start, start + raw.numel() * raw.element_size()))
        if len(t.shape) == 1:
            assert np.array_equal(lane.vec[name].cpu().numpy(), dequantize(t.data, t.format, t.shape, dtype=np.float32))
        else:
            want = stored.stored_bytes(t.format, np.asarray(t.data), stored.file_row_bytes(t.format, tuple(t.shape)))
            assert np.array_equal(raw.cpu().numpy().reshape(-1), want), name
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_every_step_lays_its_activations_out_in_the_lanes_one_arena(tmp_path):
    from fuselane.graph.ir import Role

    # a step is made for each row count a prompt's last chunk has: they share one arena, so memory does not grow
    # with every prompt length met. A step needing more replaces it (at least twice the size) for the steps
    # made after; the steps made before keep theirs, and every step keeps the cpu lane's numbers
    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "f16", seed=4)
    gpu = load(path, lane="cuda", ctx=64, knobs=["activations=dequant"])
    ref = load(path, lane="cpu", ctx=64, dtype=np.float64)
    lane = gpu.lane
    tol = lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)

    def arena_of(rows: int) -> int:
        step = lane._steps[(rows, False)]
        g = step.plan.graph
        acts = [n for n, t in step.bufs.items() if n in g.tensors and g.tensors[n].role is Role.ACTIVATION]
        assert acts and len({step.bufs[n].untyped_storage().data_ptr() for n in acts}) == 1
        return step.bufs[acts[0]].untyped_storage().data_ptr()

    a, b = gpu.session(), ref.session()
    sizes = []
    for piece in [[5, 60, 7, 300, 8, 1, 2, 3], [4, 5, 6], [9], list(range(10, 31)), [1, 2, 3]]:
        x, y = a.extend(piece), b.extend(piece)
        assert np.isfinite(x).all() and rel(x, y) <= tol, f"{len(piece)} rows: {rel(x, y):.2e} > {tol:.2e}"
        sizes.append(lane._arena.numel())
    assert sizes[0] == sizes[1] == sizes[2] < sizes[3] == sizes[4], sizes  # 3 and 1 rows fit the 8 rows' arena
    assert sizes[3] >= 2 * sizes[0]
    assert arena_of(8) == arena_of(3) == arena_of(1) != arena_of(21) == lane._arena.untyped_storage().data_ptr()
    # and one logits buffer: each step's logits are read before the next step runs
    assert len({step.bufs["logits"].data_ptr() for step in lane._steps.values()}) == 1


def test_the_scratch_is_sized_against_the_lanes_own_weights_and_caches(tmp_path):
    # `run/workspace` takes the weights the lane uploaded, the caches a chunk binds and that chunk's arena and
    # logits: the same bytes the lane then holds, so the share it sizes the scratch to is the model's
    from fuselane.graph.ir import Role
    from fuselane.lanes.cuda.plan.kernels import WORKSPACE_SHARE
    from fuselane.lanes.cuda.run.buffers import arena_values

    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3", "q8_0", seed=4)
    gpu = load(path, lane="cuda", ctx=32, knobs=["activations=dequant", "prefill=f16-scratch"])
    gpu.session().feed(PROMPT)
    lane = gpu.lane
    ws = lane.workspace
    caches = sum(c.numel() * c.element_size() for c in lane.caches.values())
    assert lane.weights_bytes == lane.raw["token_embd.weight"][0].untyped_storage().nbytes()
    file_bytes = lane.weights_bytes - lane.stored_surplus  # the stored layout's rows padded: held in the share
    assert ws.share_bytes == int(WORKSPACE_SHARE * (file_bytes + caches))
    assert lane.model_bytes() == file_bytes + caches  # what `bench` puts the peak over
    step = lane._steps[(len(PROMPT), False)]
    logits = sum(b.numel() * 4 for n, b in step.bufs.items() if step.plan.graph.tensors[n].role is Role.OUTPUT)
    chunk = lane.plan(min(512, lane.ctx))
    candidates = gpu.cfg.vocab * (4 + 8)  # a sampled draw's values and indices
    held = max(4 * arena_values(chunk), lane._arena.numel() * 4) + logits + candidates + lane.stored_surplus
    assert ws.held_bytes == held
    assert lane.f16_scratch().numel() == ws.scratch_values


@pytest.mark.parametrize("prefill", ["f16-scratch", "f16-copy"])
def test_rounding_dying_activations_in_place_gives_the_same_logits(tmp_path, prefill):
    # `round_in_place=on`: a chunk's products round the activations that die at them (the down's SwiGLU output,
    # the pair's normed input) into their own bytes, to the bits the copies give
    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen2", "q8_0", seed=4)
    runs = {}
    for rounding in ("off", "on"):
        knobs = ["activations=dequant", f"prefill={prefill}", f"round_in_place={rounding}"]
        gpu = load(path, lane="cuda", ctx=32, knobs=knobs)
        runs[rounding] = (_steps(gpu), gpu.lane._steps[(len(PROMPT), False)])
    (copied, copies_step), (rounded, rounding_step) = runs["off"], runs["on"]
    assert rounding_step.rounds_in_place and not copies_step.rounds_in_place
    for a, b in zip(copied, rounded, strict=True):
        assert np.array_equal(a, b)
