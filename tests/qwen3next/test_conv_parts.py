"""The rule `conv_parts` and the cuda lane's launch of several convolutions (ConvParts), on small hand-built
decode steps: Qwen3-Next convolves q, k and v as one, so its steps have no two convolutions one launch takes.

A step of three convolutions through their SiLU (two plain, one with its query and key heads L2-normed in its
epilogue), each over its own product of the step's row with its own state: the rule takes them as one launch,
and the fused plan computes, on the cpu lane in f64, the plain graph's numbers over three steps (the states
carried); it leaves a convolution that reads another's output, or one that cannot move up past an op that
writes its input; the lane's fits refuse five parts (the four after the first then fuse), or parts of two
lengths of taps. The lane's binder runs
the fused op as one launch whose every part equals the cpu lane's kernels (bounds as
`tests/cuda_kernels/test_gdn_kernels.py`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace

import numpy as np
import pytest

if importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU

from fuselane.fuse.optimizer import optimize
from fuselane.fuse.views import class_of, leaves
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import WHOLE, Dst, Form, Op, Role, Tensor, TensorGraph, Values
from fuselane.graph.ops import (
    CausalConv,
    ConvShift,
    Elementwise,
    ElementwiseOp,
    L2Norm,
    Matmul,
    PrimSpec,
    RowsGather,
    Slice,
    Unary,
    UnaryOp,
)
from fuselane.lanes.cpu.lane import CpuLane
from fuselane.lanes.cuda.plan.knobs import CudaKnobs
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.models.qwen import IDS, LOGITS, POS

F64 = np.dtype(np.float64)
D, C_PLAIN, HEAD, EPS = 32, 64, 32, 1e-6  # D: whole 32-value blocks, as the lane's products take
NORMED_CHAN = 3 * HEAD  # one query head, one key head, one value head
SILU_ROUNDINGS = 8  # the sigmoid's exponential (approximate on a GPU: 4u), its add and division, the product
SHIM = CudaShim(CudaKnobs.parse(["activations=dequant"]))
PARTS_REFUSED = (
    "one launch convolves a step's one row through the SiLU in at most four parts of one length of taps, the "
    "normed ones over heads of one width"
)


@dataclass(frozen=True)
class Weight:
    """A checkpoint tensor as the cpu lane reads one: shape, format and bytes."""

    shape: tuple[int, ...]
    format: Format
    data: np.ndarray


class Step:
    """A decode step built op by op over random f32 weights."""

    def __init__(self, seed: int = 0) -> None:
        self.g = TensorGraph(Form.DECODE, 1, inputs=(IDS,), params=(POS,), outputs=(LOGITS,))
        self.g.add(Tensor(IDS, (1,), Values("i32"), Role.INPUT))
        self.g.add(Tensor(POS, (), Values("i32"), Role.PARAM))
        self.weights: dict[str, Weight] = {}
        self.rng = np.random.default_rng(seed)
        self.x = self.op(RowsGather(1, D), (self.weight("table", 8, D), IDS), "x", D)

    def weight(self, name: str, *shape: int) -> str:
        values = (self.rng.standard_normal(shape) * 0.5).astype(np.float32)
        self.weights[name] = Weight(shape, Format.F32, values.view(np.uint8).reshape(-1))
        return self.g.add(Tensor(name, shape, Values("f32"), Role.WEIGHT))

    def op(self, sym: PrimSpec, ins: tuple[str, ...], out: str, cols: int, role: Role = Role.ACTIVATION) -> str:
        self.g.add(Tensor(out, (1, cols), Values("f32"), Role.OUTPUT if out == LOGITS else role))
        self.g.emit(sym, ins, out)
        return out

    def conv(self, name: str, x: str, chan: int, taps: int = 4) -> str:
        """silu(conv(x)) with its state's shift, as a linear layer's convolution."""
        state = self.g.add(Tensor(f"{name}.state", (taps - 1, chan), Values("f32"), Role.STATE))
        raw = self.op(CausalConv(1, chan, taps), (x, state, self.weight(f"{name}.w", chan, taps)), f"{name}.raw", chan)
        self.g.emit(ConvShift(1, chan, taps - 1), (x, state), state, Dst(state))
        return self.op(Unary(UnaryOp.SILU, 1, chan), (raw,), f"{name}.act", chan)

    def product(self, name: str, x: str, n: int) -> str:
        return self.op(Matmul(1, n, self.g.tensors[x].shape[-1]), (x, self.weight(f"{name}.m", n, D)), name, n)

    def normed(self, name: str, act: str) -> str:
        """The query and key heads of a normed convolution's output, L2-normed, summed with its values."""
        parts = [self.op(Slice(1, NORMED_CHAN, i * HEAD, HEAD), (act,), f"{name}.{p}", HEAD) for i, p in
                 enumerate("qkv")]  # fmt: skip
        qn, kn = (self.op(L2Norm(1, HEAD, EPS), (p,), f"{p}n", HEAD) for p in parts[:2])
        add = Elementwise(ElementwiseOp.ADD, 1, HEAD)
        return self.op(add, (self.op(add, (qn, kn), f"{name}.qk", HEAD), parts[2]), f"{name}.sum", HEAD)

    def lane(self) -> CpuLane:
        return CpuLane(None, self.weights, ctx=8, dtype=F64)  # type: ignore[arg-type]


def three_convolutions(*, chained: bool = False, taps: tuple[int, int, int] = (4, 4, 4)) -> Step:
    """a, b: plain convolutions of their products; c: one whose heads are normed; logits from all three.
    `chained`: b convolves a's output instead of its own product."""
    s = Step()
    xa, xb, xc = (s.product(f"p{i}", s.x, n) for i, n in enumerate((C_PLAIN, C_PLAIN, NORMED_CHAN)))
    a = s.conv("a", xa, C_PLAIN, taps[0])
    b = s.conv("b", a if chained else xb, C_PLAIN, taps[1])
    c = s.normed("c", s.conv("c", xc, NORMED_CHAN, taps[2]))
    ab = s.op(Elementwise(ElementwiseOp.ADD, 1, C_PLAIN), (a, b), "ab", C_PLAIN)
    s.op(Matmul(1, HEAD, C_PLAIN), (ab, s.weight("down", HEAD, C_PLAIN)), "abd", HEAD)
    s.op(Elementwise(ElementwiseOp.ADD, 1, HEAD), ("abd", c), LOGITS, HEAD)
    return s


def run(g: TensorGraph, lane: CpuLane, steps: int = 3) -> np.ndarray:
    return np.concatenate([np.ravel(lane.run(g, np.array([t + 1]), t)) for t in range(steps)])


def convolutions_of(plan) -> list[Op]:
    return [op for op in plan.graph.ops if class_of(op) is C.CONV_PARTS]


def test_the_steps_convolutions_run_as_one_launch_with_the_plain_numbers():
    s = three_convolutions()
    plan = optimize(s.g, SHIM)
    (fused,) = convolutions_of(plan)
    assert [class_of(p) for p in fused.sym.parts] == [C.CONV_BIAS_SILU, C.CONV_BIAS_SILU, C.CONV_SILU_L2NORM]
    assert [e.rule for e in plan.fired if e.cls is C.CONV_PARTS] == ["conv_parts"]
    assert np.array_equal(run(plan.graph, s.lane()), run(s.g, s.lane()))


def test_a_convolution_of_another_ones_output_is_not_a_part_of_its_launch():
    s = three_convolutions(chained=True)
    plan = optimize(s.g, SHIM)
    (fused,) = convolutions_of(plan)
    taken = {p.out for p in fused.sym.parts}
    assert "b.act" not in taken and {"a.act", "cn"} & taken  # a and c together; b reads a
    assert np.array_equal(run(plan.graph, s.lane()), run(s.g, s.lane()))


def test_a_convolution_does_not_move_past_an_op_that_writes_its_input():
    s = three_convolutions()
    ops = s.g.ops
    k = next(i for i, op in enumerate(ops) if op.out == "a.act") + 1
    doubled = Op(Elementwise(ElementwiseOp.ADD, 1, C_PLAIN), ("p1", "p1"), (WHOLE, WHOLE), "p1", Dst("p1"))
    s.g.ops = [replace(o, covers=(n,)) for n, o in enumerate([*ops[:k], doubled, *ops[k:]])]
    plan = optimize(s.g, SHIM)
    assert all("b.act" not in {p.out for p in op.sym.parts} for op in convolutions_of(plan))
    assert np.array_equal(run(plan.graph, s.lane()), run(s.g, s.lane()))


def test_the_lane_takes_one_length_of_taps_a_launch():
    plan = optimize(three_convolutions(taps=(4, 3, 4)).g, SHIM)
    assert not convolutions_of(plan)
    assert {m.reason for m in plan.missed if m.cls is C.CONV_PARTS} == {PARTS_REFUSED}


def test_the_lane_takes_at_most_four_convolutions_a_launch():
    s = Step()
    products = [s.product(f"p{i}", s.x, C_PLAIN) for i in range(5)]
    acts = [s.conv(f"c{i}", x, C_PLAIN) for i, x in enumerate(products)]
    total = acts[0]
    for i, a in enumerate(acts[1:]):
        total = s.op(Elementwise(ElementwiseOp.ADD, 1, C_PLAIN), (total, a), LOGITS if i == 3 else f"t{i}", C_PLAIN)
    plan = optimize(s.g, SHIM)
    assert {m.reason for m in plan.missed if m.cls is C.CONV_PARTS} == {PARTS_REFUSED}  # the five together
    (fused,) = convolutions_of(plan)  # then, from the second, the four after the first
    assert [p.out for p in fused.sym.parts] == [f"c{i}.act" for i in range(1, 5)]
    assert np.array_equal(run(plan.graph, s.lane()), run(s.g, s.lane()))


# --- the lane's launch (interpreted on a CPU) -----------------------------------------------------------------


def test_the_lanes_launch_convolves_every_part_as_the_cpu_lane():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from fuselane.lanes.cpu import gdn_kernels as ref
    from fuselane.lanes.cuda.run.launch import Bound, bind
    from tests.cuda_kernels.kernel_checks import U32, gamma, norm_rel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    s = three_convolutions()
    plan = optimize(s.g, SHIM)
    (fused,) = convolutions_of(plan)
    rng = np.random.default_rng(9)
    host: dict[str, np.ndarray] = {}
    bufs, raw = {}, {}
    for name, t in plan.graph.tensors.items():
        if t.role is Role.WEIGHT:
            raw[name] = (torch.from_numpy(s.weights[name].data).to(device), Format.F32)
        elif name not in (IDS, POS):
            host[name] = rng.standard_normal(t.shape)
            bufs[name] = torch.from_numpy(host[name].astype(np.float32)).to(device)
    b = Bound(plan.graph, bufs, raw, {}, lambda name: None)
    (launch,) = bind(fused, b)
    launch()
    taps = 4
    conv_bound = taps * gamma(taps + SILU_ROUNDINGS)  # relative to the largest output
    for member in fused.sym.parts:
        cv = next(x for x in leaves(member) if isinstance(x.sym, CausalConv))
        silu = next(x for x in leaves(member) if isinstance(x.sym, Unary))
        x, state = host[cv.ins[0]], host[cv.ins[1]]
        w = s.weights[cv.ins[2]].data.view(np.float32).reshape(cv.sym.chan, cv.sym.taps)
        want = ref.causal_conv(cv.sym, [x, state, w.astype(np.float64)], 0)
        want = want / (1 + np.exp(-want))
        got = bufs[silu.out].double().cpu().numpy()
        assert np.max(np.abs(got - want)) <= conv_bound * np.max(np.abs(want))
        moved = ref.conv_shift(ConvShift(1, cv.sym.chan, cv.sym.taps - 1), [x, state], 0)
        assert np.max(np.abs(bufs[cv.ins[1]].double().cpu().numpy() - moved)) <= U32 * np.max(np.abs(moved))
        for norm in (x for x in leaves(member) if isinstance(x.sym, L2Norm)):
            start = next(p.sym.start for p in leaves(member) if p.out == norm.ins[0])
            head = want[:, start : start + HEAD]
            exact = head / np.sqrt(np.sum(head * head) + EPS)
            err = np.max(np.abs(bufs[norm.out].double().cpu().numpy() - exact))
            assert err <= (norm_rel(HEAD) + conv_bound) * np.max(np.abs(exact))
