"""The cuda lane on Qwen3-Next with the launches that take what ran apart, every launch under Triton's
interpreter, against the cpu lane in f64 within the lane's numerics contract (`logits_tolerance`), on a tiny
hybrid (one gated delta-rule layer, one gated full-attention layer): a prompt of a few rows and a decode step,
or under int8 activations (whose interpreted products are slow) two decode steps.

- A file holding its matrices in F16: a step's (and a short chunk's) `ssm_ba` product rides the layer's GEMV in
  parts, the delta step making the gates; with `gemv_parts` held the gates take their projection in their own
  launch (GdnGateProjections, from the lane's f32 copy of the matrix); under both `state` precisions.
- Under int8 activations, heads of 32 values (whole blocks): the gated norm writes `ssm_out`'s int8 form in its
  store (GdnOutputQuant), no Quantize launch after it; in a decode step the delta rule's launch does
  (`norm_in_step`). Interpreted, the decode step's own launches on inputs of their own (the norm's output
  within the gated norm's bound, its int8 form bit for bit `quant.quantize_reference`'s; the step's launch
  bit for bit the step's and the norm's launches: the interpreted int8 products of a whole step take
  minutes); compiled (`-m cuda`), the whole lane, with the rule and without.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import gamma, norm_rel  # noqa: E402

from fuselane.fuse.views import class_of, leaves  # noqa: E402
from fuselane.gguf.synth import SHAPES, write_synthetic  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.graph.ops import Quantize, RmsNorm  # noqa: E402
from fuselane.lanes.cuda.plan.gdn import step_writes_int8  # noqa: E402
from fuselane.lanes.cuda.triton.quant import quantize_reference  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

PROMPT = [5, 60, 7]
SILU_ROUNDINGS = 8  # the sigmoid's exponential (approximate on a GPU: 4u), its add and division, the product
TINY = replace(SHAPES["tiny-qwen3next"], n_layers=2, vocab=260, ssm_dim=32)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _same_as_the_cpu_lane(gpu, ref, prompt: list[int]) -> None:
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    sg, sr = gpu.session(), ref.session()
    steps = [("prompt", sg.feed(prompt), sr.feed(prompt)), ("decode", sg.extend([9]), sr.extend([9]))]
    for what, a, b in steps:
        assert np.isfinite(a).all(), what
        assert rel(a, b) <= tol, f"{what}: {rel(a, b):.2e} > {tol:.2e}"


def _gates_product(step, held: tuple[str, ...]) -> None:
    """Where a step's gates take their product: in their launch where `gemv_parts` is held, else in the GEMV
    in parts of the layer's input."""
    classes = {class_of(op) for op, _ in step.bound}
    in_parts = [op for op, _ in step.bound if class_of(op) is C.MERGED_QKV and any("ssm_ba" in n for n in op.ins)]
    assert (C.GDN_GATE_PROJECTIONS in classes) == bool(held)
    assert bool(in_parts) != bool(held)


@pytest.mark.parametrize("state", ["f32", "bf16"])
@pytest.mark.parametrize("held", [(), ("gemv_parts",)], ids=["in-parts", "with-the-gates"])
def test_the_gates_product_in_parts_or_in_the_gates_launch(tmp_path, state, held):
    path = write_synthetic(tmp_path / "m.gguf", TINY, "f16", seed=4)
    gpu = load(path, lane="cuda", ctx=16, knobs=[f"state={state}", "activations=dequant"], held=held)
    ref = load(path, lane="cpu", ctx=16, dtype=np.float64)
    for rows in (1, len(PROMPT)):  # both within the GEMV's rows
        _gates_product(gpu.lane.step(rows), held)
    _same_as_the_cpu_lane(gpu, ref, PROMPT)


def _int8_lane(tmp_path, held=()):
    path = write_synthetic(tmp_path / "m.gguf", TINY, "q8_0", seed=5)
    return path, load(path, lane="cuda", ctx=16, knobs=["state=f32", "activations=int8"], held=held)


def test_the_gated_norms_launch_writes_the_int8_form_ssm_out_reads(tmp_path):
    # the decode step's own launch (the norm apart from the step's: `norm_in_step` held), on inputs of its own:
    # the interpreted int8 products of a whole step take minutes (the compiled test below runs the whole lane)
    _, gpu = _int8_lane(tmp_path, held=("norm_in_step",))
    step = gpu.lane.step(1)
    ((op, (launch,)),) = [(op, ls) for op, ls in step.bound if class_of(op) is C.GDN_OUTPUT_QUANT]
    assert not [o for o, _ in step.bound if isinstance(o.sym, Quantize) and o.out == op.out]
    norm_op, w_op, silu_op, _ = leaves(op)
    spec: RmsNorm = norm_op.sym  # type: ignore[assignment]
    rng = np.random.default_rng(6)
    x, z = (rng.standard_normal(step.bufs[n].shape) for n in (norm_op.ins[0], silu_op.ins[0]))
    step.bufs[norm_op.ins[0]].copy_(torch.from_numpy(x)), step.bufs[silu_op.ins[0]].copy_(torch.from_numpy(z))
    launch()
    w = gpu.lane.vec[w_op.ins[1]].double().numpy()
    xs, zs = x.reshape(spec.rows, spec.cols), z.reshape(spec.rows, spec.cols)
    want = xs / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + spec.eps) * w * zs / (1 + np.exp(-zs))
    got = step.bufs[op.out].double().numpy().reshape(want.shape)
    assert rel(got, want) <= norm_rel(spec.cols) + gamma(SILU_ROUNDINGS)
    codes, scales, sums = quantize_reference(step.bufs[op.out].numpy().reshape(1, -1))
    q8 = step.q8[op.out]
    assert np.array_equal(q8.q.numpy(), codes) and np.array_equal(q8.d.numpy(), scales)
    assert np.array_equal(q8.s.numpy(), sums)


def _fill(step, names, seed: int) -> None:
    """The same random values, name by name in order, into those of `names` the step holds as f32 buffers."""
    rng = np.random.default_rng(seed)
    for n in names:
        buf = step.bufs.get(n)
        if buf is not None and buf.dtype == torch.float32:
            buf.copy_(torch.from_numpy(rng.standard_normal(buf.shape) * 0.5))


def test_the_steps_launch_norms_its_output_as_the_norms_own_launch(tmp_path):
    # `norm_in_step`: the decode step's GdnStep writes the gated norm's output and its int8 form; on the same
    # inputs, the step then the gated norm's launch (the rule held) write the same numbers and state
    _, fused = _int8_lane(tmp_path)
    _, apart = _int8_lane(tmp_path, held=("norm_in_step",))
    one, two = fused.lane.step(1), apart.lane.step(1)
    ((op, (launch,)),) = [(op, ls) for op, ls in one.bound if step_writes_int8(op)]
    (step_launch,) = next(ls for o, ls in two.bound if class_of(o) is C.GDN_STEP)
    (norm_launch,) = next(ls for o, ls in two.bound if class_of(o) is C.GDN_OUTPUT_QUANT)
    assert not [o for o, _ in one.bound if class_of(o) in (C.GATED_NORM, C.GDN_OUTPUT_QUANT)]
    names = sorted(n for n in op.ins)
    _fill(one, names, 7), _fill(two, names, 7)
    launch()
    step_launch(), norm_launch()
    state = next(n for n in op.ins if n.endswith("delta_state"))
    assert np.array_equal(one.bufs[state].numpy(), two.bufs[state].numpy())
    assert np.array_equal(one.bufs[op.out].numpy(), two.bufs[op.out].numpy())
    for part in ("q", "d", "s"):
        assert np.array_equal(getattr(one.q8[op.out], part).numpy(), getattr(two.q8[op.out], part).numpy())


@pytest.mark.cuda
@pytest.mark.parametrize("held", [(), ("norm_in_step",)])
def test_the_lane_with_the_gated_norms_int8_form_equals_the_cpu_lane(tmp_path, held):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    path, gpu = _int8_lane(tmp_path, held)
    bound = [op for op, _ in gpu.lane.step(1).bound]
    assert any(class_of(op) is C.GDN_OUTPUT_QUANT or step_writes_int8(op) for op in bound)
    _same_as_the_cpu_lane(gpu, load(path, lane="cpu", ctx=16, dtype=np.float64), PROMPT)


REAL = replace(SHAPES["qwen3-next-80b-a3b"], n_layers=4, vocab=512, experts=16)
DECODES = 4  # the third decode step is captured as a CUDA graph, the fourth replayed


def _captured_steps_as_the_cpu_lane(gpu, path) -> None:
    """The prompt's and DECODES steps' logits of `gpu` within its contract of the cpu lane's in f64 on `path`."""
    ref = load(path, lane="cpu", ctx=32, dtype=np.float64)
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    sg, sr = gpu.session(), ref.session()
    pairs = [(sg.feed(PROMPT), sr.feed(PROMPT))] + [(sg.extend([t]), sr.extend([t])) for t in range(11, 11 + DECODES)]
    for i, (a, b) in enumerate(pairs):
        assert rel(a, b) <= tol, f"step {i}: {rel(a, b):.2e} > {tol:.2e}"


@pytest.mark.cuda
@pytest.mark.xdist_group("qwen3next-f16")  # one worker compiles the F16 kernels once for both states
@pytest.mark.parametrize(("state", "held"), [("f32", ()), ("bf16", ("gemv_parts",))])
def test_the_real_shape_in_f16_runs_the_gates_product_in_the_graph(tmp_path, state, held):
    """Four layers of the real shape with every matrix F16: the gates' product in the captured decode step's GEMV
    in parts (or, `gemv_parts` held, with the gates in their launch), its logits within the contract of the cpu
    lane's in f64."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    path = write_synthetic(tmp_path / "m.gguf", REAL, "f16", seed=6)
    gpu = load(path, lane="cuda", ctx=32, knobs=[f"state={state}"], held=held)
    _gates_product(gpu.lane.step(1), held)
    _captured_steps_as_the_cpu_lane(gpu, path)


@pytest.mark.cuda
@pytest.mark.parametrize("activations", ["int8", "dequant"])
def test_the_real_shape_in_q4_k_m_runs_two_formats_in_each_gemv_in_parts(tmp_path, activations):
    """Four layers of the real shape in llama.cpp's Q4_K_M recipe: layer 2's Q6_K q/k/v rows beside its Q4_K gate
    and gates, the full-attention layer's Q6_K value rows beside its Q4_K query/gate and key, each layer's products
    of its input in one GEMV (of two formats in those two): the int8 GEMV, or under dequant the f32 GEMV by rows;
    the captured step's logits within the contract of the cpu lane's in f64."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from fuselane.gguf.formats import Format
    from fuselane.gguf.synth import tensor_formats

    formats = tensor_formats(REAL, "q4_k_m")
    assert formats["blk.2.attn_qkv.weight"] is Format.Q6_K and formats["blk.3.attn_v.weight"] is Format.Q6_K
    path = write_synthetic(tmp_path / "m.gguf", REAL, "q4_k_m", seed=7)
    gpu = load(path, lane="cuda", ctx=32, knobs=[f"activations={activations}"])
    bound = [class_of(op) for op, _ in gpu.lane.step(1).bound]
    assert bound.count(C.MERGED_QKV) == REAL.n_layers and C.ROW_WRITE not in bound
    _captured_steps_as_the_cpu_lane(gpu, path)


def test_two_formats_share_a_step_gemv_reading_f32(tmp_path):
    # activations=dequant: the delta-rule layer's Q8_0 q/k/v and gate rows beside its F32 gates' rows, the
    # full-attention layer's Q8_0 query/gate and key beside its Q4_0 value rows, each one launch of the f32 GEMV
    # by rows in two formats; the prompt's and a decode step's logits within the contract of the cpu lane in f64
    from fuselane.gguf.formats import Format

    formats = {"blk.0.ssm_ba.weight": Format.F32, "blk.1.attn_v.weight": Format.Q4_0}
    path = write_synthetic(tmp_path / "m.gguf", TINY, "q8_0", seed=6, formats=formats)
    gpu = load(path, lane="cuda", ctx=16, knobs=["activations=dequant"])
    merged = [op for op, _ in gpu.lane.step(1).bound if class_of(op) is C.MERGED_QKV]
    assert {n for op in merged for n in op.ins} >= set(formats)
    assert not [op for op, _ in gpu.lane.step(1).bound if class_of(op) is C.ROW_WRITE]
    _same_as_the_cpu_lane(gpu, load(path, lane="cpu", ctx=16, dtype=np.float64), PROMPT)
