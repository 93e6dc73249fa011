"""The cuda lane's prefill of a mixture through the grouped expert GEMM (`triton.moe.grouped`), every launch
under Triton's interpreter, against the cpu lane in f64 within the lane's numerics contract.

The widths are ones the grouped GEMM takes (rows of whole 128-value steps of Q4_0 and Q8_0; the K formats are
`test_moe_grouped.py`'s),
the prompt past the GEMV's rows, one layer and a small vocabulary (the interpreter's time goes to the lm
head). The test counts the grouped launches, so a chunk that fell back to the per-pair kernels fails it.
Routing: the lane must keep the experts the cpu lane keeps in every row (a mismatch reports the reference's
smallest lead of the k-th score, to tell a near-tie from a bug), as `test_moe_lane_interpreted.py`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from test_moe_lane_interpreted import _record_routing, rel  # noqa: E402

from fuselane.gguf.synth import Shape, write_synthetic  # noqa: E402
from fuselane.lanes.cuda.triton.moe import grouped, route  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

PROMPT = [5, 60, 7, 100, 8, 1, 2, 3, 4, 5, 6, 9, 11]  # past the GEMV's rows
CASES = {
    # 32-value blocks (Q4_0), the residual and the next norm in the down launch, weights renormalised
    "qwen3moe-q4_0": (
        Shape("qwen3moe", 128, 2, 4, 2, 32, 256, 260, context=4096, experts=4, experts_used=2, expert_ff=128),
        "q4_0",
    ),
    # a shared expert (computed apart in a chunk, added after), routing weights not renormalised
    "qwen2moe-q8_0": (
        Shape(
            "qwen2moe", 128, 1, 4, 2, 32, 128, 260, context=4096, experts=8, experts_used=3, expert_ff=128,
            shared_ff=128,
        ),
        "q8_0",
    ),
}  # fmt: skip


class _Counted:
    """Counts the calls of a module function, then calls it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


class _Routed(_Counted):
    """`route.route`, keeping a copy of the ids each call wrote (their buffer is reused by later layers)."""

    def __init__(self, fn):
        super().__init__(fn)
        self.ids: list[np.ndarray] = []

    def __call__(self, *args, **kwargs):
        super().__call__(*args, **kwargs)
        self.ids.append(args[6].numpy().copy())


@pytest.mark.parametrize("case", list(CASES))
def test_a_chunk_runs_its_experts_as_the_grouped_gemm(tmp_path, monkeypatch, case):
    shape, mix = CASES[case]
    path = write_synthetic(tmp_path / "m.gguf", shape, mix, seed=6)
    gate_up, down = _Counted(grouped.gate_up_grouped), _Counted(grouped.down_grouped)
    monkeypatch.setattr(grouped, "gate_up_grouped", gate_up)
    monkeypatch.setattr(grouped, "down_grouped", down)
    lane_routes = _Routed(route.route)
    monkeypatch.setattr(route, "route", lane_routes)
    gpu = load(path, lane="cuda", ctx=16)
    ref = load(path, lane="cpu", ctx=16, dtype=np.float64)
    routed = _record_routing(monkeypatch)
    a, b = gpu.session().feed(PROMPT), ref.session().feed(PROMPT)
    assert gate_up.calls == down.calls == shape.n_layers, "the chunk's experts did not run as the grouped GEMM"
    for layer, ((scores, want), got) in enumerate(zip(routed, lane_routes.ids, strict=True)):
        k = got.shape[-1]
        ranked = np.sort(scores, axis=-1)[:, ::-1]
        lead = float(np.min(ranked[:, k - 1] - ranked[:, k]))
        assert np.array_equal(np.sort(got, -1), np.sort(want, -1)), f"layer {layer}: other experts (lead {lead:.2e})"
    tol = gpu.lane.shim.numerics().logits_tolerance(gpu.cfg.n_layers)
    assert np.isfinite(a).all()
    assert rel(a, b) <= tol, f"{rel(a, b):.2e} > {tol:.2e}"
