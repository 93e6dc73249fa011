"""A decode step's routing in the add + norm GEMV's launch (`triton/moe/norm_route.py`) against the two launches it
replaces: `q8_epilogue.gemv_q8_add_norm` (or the f32 `fast_norm.gemv_fast_add_norm`) then `route.route` on the
normed row, under the interpreter on a CPU
(compiled on a GPU, `-m cuda`).

The sum, the normed row and its int8 form are the same arithmetic, so the same bits. The scores are r * sum(W_r * g
* s) instead of sum(W_r * out), each program's share summed in a fixed order: within gamma_(n + 4) of
sum |W_r| |out| of the f64 scores (Higham 3.1; r and g's products a few roundings more), the same at every launch.
The kept experts equal the f64 scores' (a seed whose k-th and next scores lie further apart than the bound), and
their weights are the f64 softmax's (or sigmoid's) within a few f32 roundings. The counters come back at zero.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, dev, gamma, raw_weights  # noqa: E402

from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.plan import moe_kernels  # noqa: E402
from fuselane.lanes.cuda.triton import quant  # noqa: E402
from fuselane.lanes.cuda.triton.gemv import epilogue, fast_norm, q8_epilogue  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.fast import launch_plan  # noqa: E402
from fuselane.lanes.cuda.triton.gemv.q8 import tile_plan  # noqa: E402
from fuselane.lanes.cuda.triton.moe import norm_route, route  # noqa: E402

EPS = 1e-6
ROUNDINGS = 4  # r times g times s, and the scale of the sum by r


def _router(fmt: Format, experts: int, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(the router's values as f64, its bytes as a GGUF holds them) in F32, F16 or BF16."""
    w = rng.standard_normal((experts, n)).astype(np.float32)
    if fmt is Format.F16:
        w16 = w.astype(np.float16)
        return w16.astype(np.float64), w16.view(np.uint8)
    if fmt is Format.BF16:
        top = w.view(np.uint32) >> 16
        return (top << 16).view(np.float32).astype(np.float64), top.astype(np.uint16).view(np.uint8)
    return w.astype(np.float64), w.view(np.uint8)


def _expected(scores: np.ndarray, k: int, renorm: bool, sigmoid: bool, bias: np.ndarray | None, scale: float):
    p = (
        1.0 / (1.0 + np.exp(-scores))
        if sigmoid
        else np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    )
    choice = p + bias if bias is not None else (p if sigmoid else scores)
    ids = np.argsort(-choice, kind="stable")[:k]
    kept = p[ids] / p[ids].sum() if renorm else p[ids]
    return ids, choice, kept * scale


CASES = {
    # (weights' format, n, k, experts, top k, renorm, sigmoid, bias, scale, router format, int8 activations)
    "qwen3moe-softmax": (Format.Q4_K, 224, 256, 16, 4, True, False, False, 1.0, Format.F32, True),
    "deepseek2-scaled": (Format.Q8_0, 96, 128, 12, 3, False, False, False, 2.5, Format.F32, True),
    "deepseek3-sigmoid-bias": (Format.Q8_0, 160, 128, 24, 4, True, True, True, 1.5, Format.F32, True),
    "experts-not-a-power-of-two-f16": (Format.Q4_K, 96, 256, 60, 4, False, False, False, 1.0, Format.F16, True),
    "bf16-router": (Format.Q5_0, 128, 64, 8, 2, True, False, False, 1.0, Format.BF16, True),
    # the f32 activation on the fast GEMV (an F16 or BF16 file, or activations=dequant)
    "f16-file": (Format.F16, 96, 128, 12, 3, True, False, False, 1.0, Format.F16, False),
    "f32-q4k-sigmoid": (Format.Q4_K, 128, 256, 20, 4, True, True, True, 2.0, Format.F32, False),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_routing_in_the_norms_launch_is_the_two_launches(case):
    fmt, n, k, experts, top_k, renorm, sigmoid, with_bias, scale, rfmt, int8 = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    raw = raw_weights(fmt, n, k, rng)
    x = rng.standard_normal(k).astype(np.float32)
    codes, d, s = quant.quantize_reference(x.reshape(1, -1))
    acts = quant.Q8Acts(dev(codes), dev(d), dev(s))
    res = rng.standard_normal(n).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    wr, wr_bytes = _router(rfmt, experts, n, rng)
    bias = rng.uniform(-0.1, 0.1, experts).astype(np.float32) if with_bias else None
    gating = dict(sigmoid=sigmoid, bias=dev(bias) if bias is not None else None, scale=scale)
    w, router, g = dev(raw), dev(wr_bytes), dev(norm_w)
    plan = tile_plan(fmt, k, None, None, None, n=n) if int8 else launch_plan(fmt, k, None, None, n=n)
    group, groups = moe_kernels.moe_route_groups(-(-n // plan["BLOCK_N"]))
    assert groups > 1, "two levels: the groups' sums and the launch's"

    def add_norm(sum_out, out, q8):
        if int8:
            return q8_epilogue.gemv_q8_add_norm(acts, w, fmt, n, k, sum_out, sum_out, g, EPS, out, q8, counter)
        return fast_norm.gemv_fast_add_norm(dev(x), w, fmt, n, k, sum_out, sum_out, g, EPS, out, counter)

    # the two launches
    sum_a, out_a, q8_a = dev(res.copy()), torch.zeros(n, device=DEVICE), quant.empty_q8(1, n, DEVICE)
    ids_a, weights_a = torch.zeros(top_k, dtype=torch.int32, device=DEVICE), torch.zeros(top_k, device=DEVICE)
    counter = epilogue.gemv_add_norm_counter(DEVICE)
    add_norm(sum_a, out_a, q8_a)
    scores_a, route_counter = torch.zeros(experts, device=DEVICE), route.counters(DEVICE)
    route.route(out_a.view(1, n), router, rfmt, experts, top_k, renorm, ids_a, weights_a, scores_a, route_counter,
                **gating)  # fmt: skip

    # the one launch, twice: its counters re-arm, and its sums run in the same order
    scratch = norm_route.route_scratch(DEVICE, fmt, n, k, experts, int8)
    seen = []
    for _ in range(2):
        sum_b, out_b, q8_b = dev(res.copy()), torch.zeros(n, device=DEVICE), quant.empty_q8(1, n, DEVICE)
        ids_b, weights_b = torch.zeros(top_k, dtype=torch.int32, device=DEVICE), torch.zeros(top_k, device=DEVICE)
        routing = norm_route.Routing(router, rfmt, experts, top_k, renorm, ids_b, weights_b, scratch, **gating)
        if int8:
            norm_route.gemv_q8_add_norm_route(acts, w, fmt, n, k, sum_b, sum_b, g, EPS, out_b, q8_b, counter, routing)
        else:
            norm_route.gemv_fast_add_norm_route(dev(x), w, fmt, n, k, sum_b, sum_b, g, EPS, out_b, counter, routing)
        seen.append((scratch.scores[:experts].clone(), ids_b.clone(), weights_b.clone()))
        assert not counter.any() and not scratch.group_counters.any()
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1], strict=True))

    assert torch.equal(sum_b, sum_a) and torch.equal(out_b, out_a)
    if int8:
        assert all(torch.equal(a, b) for a, b in zip(q8_b, q8_a, strict=True))
    out = out_a.cpu().double().numpy()
    exact = wr @ out
    bound = gamma(n + ROUNDINGS) * (np.abs(wr) @ np.abs(out))
    got = scratch.scores[:experts].cpu().double().numpy()
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)
    want_ids, choice, want_w = _expected(exact, top_k, renorm, sigmoid, bias, scale)
    ranked = np.sort(choice)[::-1]
    assert ranked[top_k - 1] - ranked[top_k] > 1e-4, "a near-tie: pick another seed"
    assert np.array_equal(ids_b.cpu().numpy(), want_ids) and torch.equal(ids_b, ids_a)
    np.testing.assert_allclose(weights_b.cpu().numpy(), want_w, rtol=1e-5, atol=1e-7)


def test_the_groups_split_the_programs_in_about_their_square_root():
    for programs in (1, 2, 5, 24, 56, 512, 513, 1280):
        group, groups = moe_kernels.moe_route_groups(programs)
        assert group & (group - 1) == 0 and (groups - 1) * group < programs <= groups * group
        assert group * group >= programs and group < 2 * max(1, programs**0.5) + 1
