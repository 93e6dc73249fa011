"""The cuda lane on DeepSeek's latent attention, every launch under Triton's interpreter, against the cpu
lane in f64 within the lane's numerics contract: a prompt chunk past the GEMV's rows (the absorbed attention
causal over the chunk, the latent cache written a row a token) and a decode step (the per-head products, the
join, DeepSeek's rotation, the attention over the latent cache with the latents as values).

Two files: V2's routing (softmax, the kept weights as they are) and an ungrouped V3-style one (q LoRA, each
score's sigmoid ranked with the correction bias, the kept weights renormalised and scaled, YaRN). Both run
under the dequantized numerics here: the interpreter takes a minute a step through the int8 GEMVs, which
their own tests cover; the latent kernels are the same launches under either numerics.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from fuselane.fuse.views import class_of  # noqa: E402
from fuselane.gguf.synth import write_synthetic  # noqa: E402
from fuselane.gguf.synth_latent import LATENT_SHAPES  # noqa: E402
from fuselane.graph.classes import ClassId as C  # noqa: E402
from fuselane.graph.ops import HeadMatmul  # noqa: E402
from fuselane.lanes.cuda.plan.knobs import H200  # noqa: E402
from fuselane.lanes.cuda.run.mla_launch import splits  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

PROMPT = [5, 60, 7, 100, 8, 1, 2, 3, 4]  # past the GEMV's rows
VOCAB = 260  # a small head: the interpreter's time goes to the products
CTX = 64  # cache rows: a decode step cuts its span in shares (`mla_launch.splits`)
SHAPES = {
    "v2": dataclasses.replace(LATENT_SHAPES["tiny-deepseek2"], vocab=VOCAB),
    # q LoRA whole 32-value blocks (the GEMV's rows); one group: the lane routes by one top-k
    "v3-ungrouped": dataclasses.replace(LATENT_SHAPES["tiny-deepseek3"], groups=1, groups_used=1, q_lora=64,
                                        vocab=VOCAB),
}  # fmt: skip


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def within(gpu, steps) -> None:
    """Each (what, the cuda lane's logits, the cpu lane's) finite and within the lane's contract."""
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    for what, a, b in steps:
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all(), what
        assert rel(a, b) <= tol, f"{what}: {rel(a, b):.2e} > {tol:.2e}"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_cuda_lane_runs_latent_attention_as_the_cpu_lane(tmp_path, name):
    path = write_synthetic(tmp_path / "m.gguf", SHAPES[name], "q8_0", seed=3)
    gpu = load(path, lane="cuda", ctx=CTX, knobs=["activations=dequant"])
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    step = gpu.lane.step(1)
    bound = [op for op, _ in step.bound]
    assert HeadMatmul in {type(op.sym) for op in bound}  # the value half; the query's is in its join
    assert C.MLA_PROLOGUE in {class_of(op) for op in bound}  # both joins written in place by one launch
    assert C.ROUTER_TOPK in {class_of(op) for op in bound}  # the gating runs in the routing launch
    assert splits(1, 1, CTX, H200.sms, torch.device("cpu")) > 1  # the decode step's shares are merged
    sg, sr = gpu.session(), ref.session()
    within(gpu, [("prefill", sg.feed(PROMPT), sr.feed(PROMPT)), ("decode", sg.extend([9]), sr.extend([9]))])


def test_the_packed_latent_decode_runs_as_the_cpu_lane(tmp_path, monkeypatch):
    """The default `latent_decode=packed` under the int8 numerics: a decode step's latent attention takes the
    packed f16 kernel (`triton/mla/packed.py`, counted as it runs), and the lane's logits stay within the
    contract. (`cores` is the kernel the dequantized test above runs.)"""
    from fuselane.lanes.cuda.triton.mla import packed

    ran = []
    real = packed.latent_attention
    monkeypatch.setattr(packed, "latent_attention", lambda *a, **k: ran.append(k["splits"]) or real(*a, **k))
    path = write_synthetic(tmp_path / "m.gguf", SHAPES["v2"], "q8_0", seed=4)
    gpu = load(path, lane="cuda", ctx=CTX)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    sg, sr = gpu.session(), ref.session()
    long = PROMPT * 5  # 45 rows: the step's span is past one of the packed kernel's 32-row tiles, in shares
    steps = [("prefill", sg.feed(long), sr.feed(long)), ("decode", sg.extend([9]), sr.extend([9]))]
    steps.append(("a narrow chunk", sg.extend([3, 4, 5]), sr.extend([3, 4, 5])))  # rows at their own positions
    within(gpu, steps)
    assert ran and max(ran) > 1  # each layer's decode attention, its span merged from shares


def test_the_value_half_writes_its_int8_form_in_its_launch(tmp_path):
    """Under int8, heads of 32 values: the value half's per-head product writes the int8 form `attn_output`
    reads (GemvQuant), so no Quantize launch runs after it, and the logits stay within the contract."""
    from fuselane.graph.ops import Quantize

    shape = dataclasses.replace(SHAPES["v2"], vdim=32)
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", seed=5)
    gpu = load(path, lane="cuda", ctx=CTX)
    ref = load(path, lane="cpu", ctx=CTX, dtype=np.float64)
    bound = [op for op, _ in gpu.lane.step(1).bound]
    folded = [op for op in bound if class_of(op) is C.GEMV_QUANT and isinstance(op.sym.parts[0].sym, HeadMatmul)]
    assert len(folded) == shape.n_layers
    assert not [op for op in bound if isinstance(op.sym, Quantize) and op.out in {f.out for f in folded}]
    sg, sr = gpu.session(), ref.session()
    within(gpu, [("prefill", sg.feed(PROMPT), sr.feed(PROMPT)), ("decode", sg.extend([9]), sr.extend([9]))])
