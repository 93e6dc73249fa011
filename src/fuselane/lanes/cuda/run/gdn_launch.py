"""The binders of a gated delta-rule layer's classes and primitives (`launch.BINDERS`): each is one launch of
the `triton.gdn` kernels (a chunk's GdnStep two) over the lane's buffers, the recurrent states being the lane's
own (kept across steps, zeroed when a sequence starts, `lane.CudaLane`).

- ConvBiasSilu, ConvSiluL2norm, and the bare CausalConv and ConvShift: `conv.conv`, which moves the
  convolution's state in the same launch where the plan fused the shift in;
- ConvParts: `conv_parts.conv_parts`, each member's convolution a part of one launch;
- GdnGating: `gates.gates` (beta and the decay for every row and value head); GdnGateProjections:
  `gates.projected`, the `ssm_ba` product in the same launch (its matrix as f32 on the device, made once);
- GdnStep, and the bare GatedDelta and DeltaState: `delta.delta` for a decode step's row (making its gates from
  b and a where the plan put the gating in its launch, `gates_in_step`, and norming its output with the norm's
  int8 form where it put the gated norm there, `norm_in_step`); a chunk's rows in
  the chunked form, a GdnStep's in its two launches (`chunked.prepare`, `chunked.recur`), a bare primitive's
  in one (`chunked.chunked`, the whole form);
- GatedNorm: `norm.gated_norm`, which writes its int8 form in its store under GdnOutputQuant; a bare L2Norm:
  `norm.l2_norm`;
- Slice: a strided view of its input (no launch), which the kernels above and the rotations read in place.
"""

from __future__ import annotations

from typing import Any

from fuselane.fuse.optimizer import launches_of
from fuselane.fuse.views import leaves
from fuselane.gguf.formats import Format
from fuselane.graph.ir import Op
from fuselane.graph.ops import (
    CausalConv,
    ConvShift,
    DeltaState,
    Elementwise,
    GatedDelta,
    L2Norm,
    Matmul,
    RmsNorm,
    Slice,
    Unary,
    UnaryOp,
)
from fuselane.lanes.cuda.plan.gdn import (
    DELTA_FORM_LAUNCHES,
    DELTA_SPLIT,
    DELTA_WHOLE,
    GATE_MATRIX_FORMATS,
    delta_chunked,
)
from fuselane.lanes.cuda.run.mismatch import PlanMismatch


def _all(op: Op, kind: type) -> list[Op]:
    return [p for p in leaves(op) if isinstance(p.sym, kind)]


def _one(op: Op, kind: type) -> Op | None:
    found = _all(op, kind)
    return found[0] if found else None


def slice_view(op: Op, b) -> list:
    """`width` values at `start` of each `every`-wide group of the input: a (groups, width) view, no launch."""
    spec: Slice = op.sym  # type: ignore[assignment]
    flat = b.bufs[op.ins[0]].reshape(-1)
    b.bufs[op.out] = flat[spec.start :].as_strided((spec.groups, spec.width), (spec.every, 1))
    return []


def _taps(b, name: str, spec: CausalConv) -> Any:
    """The convolution's taps (chan, taps) as f32 on the device, made once from the file's F32 or F16 bytes."""
    import torch

    key = f"conv-taps:{name}"
    if key not in b.scratch:
        raw, fmt = b.raw[name]
        if fmt not in (Format.F32, Format.F16):
            raise PlanMismatch(f"{name}: the convolution takes its taps as F32 or F16, not {fmt.name}")
        values = raw.view(torch.float32 if fmt is Format.F32 else torch.float16)
        b.scratch[key] = values.float().view(spec.chan, spec.taps)
    return b.scratch[key]


def _normed(op: Op, b) -> Any:
    """The query and key heads a ConvSiluL2norm norms in its epilogue, or None where it norms none."""
    from fuselane.lanes.cuda.triton.gdn.conv import Normed

    norms = _all(op, L2Norm)
    if not norms:
        return None
    slices = {s.out: s.sym for s in _all(op, Slice)}
    q_norm, k_norm = sorted(norms, key=lambda n: slices[n.ins[0]].start)  # type: ignore[union-attr]
    spec: L2Norm = q_norm.sym  # type: ignore[assignment]
    key_width = slices[k_norm.ins[0]].start  # type: ignore[union-attr]
    if slices[q_norm.ins[0]].start != 0 or slices[k_norm.ins[0]].width != key_width:  # type: ignore[union-attr]
        raise PlanMismatch(f"{op.out}: the convolution norms its first channels' queries and the keys after them")
    return Normed(b.bufs[q_norm.out], b.bufs[k_norm.out], key_width, spec.cols, spec.eps)


def conv_parts(op: Op, b) -> list:
    """ConvParts: every member's convolution (its SiLU, its heads' norms, its state's shift) in one launch."""
    from fuselane.lanes.cuda.triton.gdn import conv_parts as kernel

    parts, specs = [], []
    for member in op.sym.parts:  # type: ignore[union-attr]
        cv, shift, silu = _one(member, CausalConv), _one(member, ConvShift), _one(member, Unary)
        if cv is None or silu is None:
            raise PlanMismatch(f"{op.out}: a launch of convolutions takes convolutions through the SiLU")
        spec: CausalConv = cv.sym  # type: ignore[assignment]
        x, state, w = b.bufs[cv.ins[0]], b.bufs[cv.ins[1]], _taps(b, cv.ins[2], spec)
        parts.append(kernel.Part(x, state, w, b.bufs[silu.out], spec.chan, shift is not None, _normed(member, b)))
        specs.append(spec)
    rows, taps = specs[0].rows, specs[0].taps
    return [lambda: kernel.conv_parts(parts, rows=rows, taps=taps)]


def conv(op: Op, b) -> list:
    """ConvBiasSilu, ConvSiluL2norm, CausalConv or ConvShift: one `conv` launch."""
    from fuselane.lanes.cuda.triton.gdn import conv as kernel

    cv, shift, silu = _one(op, CausalConv), _one(op, ConvShift), _one(op, Unary)
    if cv is None:  # the state's shift alone
        assert shift is not None
        s: ConvShift = shift.sym  # type: ignore[assignment]
        x, state = b.bufs[shift.ins[0]], b.bufs[shift.ins[1]]
        taps = s.keep + 1
        return [lambda: kernel.conv(x, state, state, None, rows=s.rows, chan=s.chan, taps=taps, silu=False, shift=True)]
    spec: CausalConv = cv.sym  # type: ignore[assignment]
    x, state, w = b.bufs[cv.ins[0]], b.bufs[cv.ins[1]], _taps(b, cv.ins[2], spec)
    out = b.bufs[silu.out if silu is not None else cv.out]
    normed = _normed(op, b)
    args = dict(rows=spec.rows, chan=spec.chan, taps=spec.taps, silu=silu is not None, shift=shift is not None)
    return [lambda: kernel.conv(x, state, w, out, normed=normed, **args)]


def _gating(op: Op) -> tuple[Op, Op, Op]:
    """A gating's beta = sigmoid(b), its a + dt and its product by A, wherever it sits (GdnGating, with its
    projection, inside a GdnStep)."""
    sig, soft = (_unary(op, kind) for kind in (UnaryOp.SIGMOID, UnaryOp.SOFTPLUS))
    add = _reading(op, lambda e: e.out == soft.ins[0])
    mul = _reading(op, lambda e: e.ins[0] == soft.out)
    return sig, add, mul


def _unary(op: Op, kind: UnaryOp) -> Op:
    return next(u for u in _all(op, Unary) if u.sym.op is kind)  # type: ignore[union-attr]


def _reading(op: Op, which) -> Op:
    """The elementwise op inside `op` that `which` picks (a step holds its gating's and its norm's)."""
    return next(e for e in _all(op, Elementwise) if which(e))


def gating(op: Op, b) -> list:
    """GdnGating: beta = sigmoid(b), g = A * softplus(a + dt), one `gates` launch."""
    from fuselane.lanes.cuda.triton.gdn import gates as kernel

    sig, add, mul = _gating(op)
    spec: Unary = sig.sym  # type: ignore[assignment]
    bv, av = b.bufs[sig.ins[0]], b.bufs[add.ins[0]]
    dt, decay = b.vec[add.ins[1]], b.vec[mul.ins[1]]
    beta, g = b.bufs[sig.out], b.bufs[mul.out]
    shape = dict(rows=spec.rows, heads=spec.cols, key_heads=bv.shape[0] // spec.rows)
    return [lambda: kernel.gates(bv, av, dt, decay, beta, g, **shape)]


def _raw_gates(op: Op, b) -> Any:
    """A GdnStep's gating (`gates_in_step`) as the inputs the step makes its gates from, or None where its gates
    come in made."""
    from fuselane.lanes.cuda.triton.gdn.delta import Raw

    if not any(u.sym.op is UnaryOp.SIGMOID for u in _all(op, Unary)):  # type: ignore[union-attr]
        return None
    sig, add, mul = _gating(op)
    return Raw(b.bufs[sig.ins[0]], b.bufs[add.ins[0]], b.vec[add.ins[1]], b.vec[mul.ins[1]])


def _gate_matrix(b, name: str, shape: tuple[int, int]) -> Any:
    """The `ssm_ba` matrix as f32 on the device, made once from the file's F32, F16 or BF16 bytes."""
    import torch

    key = f"gate-matrix:{name}"
    if key not in b.scratch:
        raw, fmt = b.raw[name]
        if fmt not in GATE_MATRIX_FORMATS:
            raise PlanMismatch(f"{name}: the gates' projection takes a matrix of floats, not {fmt.name}")
        dtypes = {Format.F32: torch.float32, Format.F16: torch.float16, Format.BF16: torch.bfloat16}
        b.scratch[key] = raw.view(dtypes[fmt]).float().view(shape).contiguous()
    return b.scratch[key]


def gate_projections(op: Op, b) -> list:
    """GdnGateProjections: the `ssm_ba` product and the gates, one `projected` launch."""
    from fuselane.lanes.cuda.triton.gdn import gates as kernel

    product = _one(op, Matmul)
    assert product is not None
    mm: Matmul = product.sym  # type: ignore[assignment]
    sig, add, mul = _gating(op)
    spec: Unary = sig.sym  # type: ignore[assignment]
    x, w = b.bufs[product.ins[0]], _gate_matrix(b, product.ins[1], (mm.n, mm.k))
    dt, decay = b.vec[add.ins[1]], b.vec[mul.ins[1]]
    beta, g = b.bufs[sig.out], b.bufs[mul.out]
    # b's slice: a group of each row's values a key head
    cut: Slice = _all(op, Slice)[0].sym  # type: ignore[assignment]
    shape = dict(rows=spec.rows, heads=spec.cols, key_heads=cut.groups // spec.rows, k=mm.k)
    return [lambda: kernel.projected(x, w, dt, decay, beta, g, **shape)]


def _chunked_scratch(b, spec: GatedDelta, device) -> Any:
    """The chunked rule's split-form scratch for a chunk of the rule's rows, one for every layer of that shape
    (they run in turn)."""
    import torch

    from fuselane.lanes.cuda.triton.gdn import chunked

    values = chunked.split_values(spec.rows, spec.heads, spec.dk, spec.dv)
    key = f"gdn-chunked:{values}"
    if key not in b.scratch:
        b.scratch[key] = torch.empty(values, dtype=torch.float32, device=device)
    return b.scratch[key]


def step(op: Op, b) -> list:
    """GdnStep (output and state), or the bare GatedDelta (output) or DeltaState (state): a decode step's row
    by the recurrence (`delta`, one launch); a chunk's rows by the chunked form, in the launches the plan
    counts (`plan.gdn.chunked_delta`): a GdnStep's two (`chunked.prepare`, then `chunked.recur`), a bare
    primitive's one (the whole form)."""
    from fuselane.lanes.cuda.triton.gdn import chunked, delta

    rule, after = _one(op, GatedDelta), _one(op, DeltaState)
    spec: GatedDelta = rule.sym if rule is not None else after.sym.rule  # type: ignore[union-attr,assignment]
    raw = _raw_gates(op, b)
    normed, normed_out = _step_norm(op, b)
    if rule is not None:
        q, k, v = (b.bufs[n] for n in rule.ins[:3])
        # a normed step writes the norm's output; its own stays in registers
        state, out = b.bufs[rule.ins[5]], normed_out if normed is not None else b.bufs[rule.out]
    else:
        assert after is not None
        (k, v), state, q, out = (b.bufs[n] for n in after.ins[:2]), b.bufs[after.ins[4]], None, None
    made = rule if rule is not None else after
    g, beta = (raw, None) if raw is not None else (b.bufs[n] for n in made.ins[-3:-1])  # type: ignore[union-attr]
    shape = dict(rows=spec.rows, heads=spec.heads, key_heads=spec.k_heads or spec.heads, dk=spec.dk, dv=spec.dv)
    write = after is not None
    if not delta_chunked(spec.rows, spec.dk):
        return [lambda: delta.delta(q, k, v, g, beta, state, out, scale=spec.scale, write_state=write,
                                    normed=normed, **shape)]  # fmt: skip
    if raw is not None or normed is not None:
        raise PlanMismatch(f"{op.out}: the chunked delta rule reads its gates made and writes its output as it is "
                           "(`plan.gdn.gates_in_step`, `plan.gdn.norm_in_step`)")  # fmt: skip
    products = dict(scale=spec.scale, precision=b.delta_products, **shape)
    if launches_of(op) == DELTA_FORM_LAUNCHES[DELTA_SPLIT]:
        scratch = _chunked_scratch(b, spec, k.device)
        return [
            lambda: chunked.prepare(q, k, v, g, beta, scratch, write_output=out is not None, **products),
            lambda: chunked.recur(q, k, g, state, out, scratch, write_state=write, **products),
        ]
    return [lambda: chunked.chunked(q, k, v, g, beta, state, out, write_state=write, form=DELTA_WHOLE, **products)]


def _gated(op: Op, b) -> tuple[Op, Any, Any, Any]:
    """A gated norm's parts, wherever it sits (GatedNorm, GdnOutputQuant, inside a GdnStep): its RmsNorm op, and
    the weight w, the gate's z and the output's buffer."""
    n_op, silu = _one(op, RmsNorm), _unary(op, UnaryOp.SILU)
    assert n_op is not None
    weight = _reading(op, lambda e: e.ins[0] == n_op.out)
    gated = _reading(op, lambda e: silu.out in e.ins)
    return n_op, b.vec[weight.ins[1]], b.bufs[silu.ins[0]], b.bufs[gated.out]


def gated_norm(op: Op, b, out_q8: Any = None) -> list:
    """GatedNorm: norm(o) * w * silu(z), one `gated_norm` launch; with `out_q8` (GdnOutputQuant) the launch
    writes the result's int8 form too."""
    from fuselane.lanes.cuda.triton.gdn import norm as kernel

    n_op, w, z, out = _gated(op, b)
    spec: RmsNorm = n_op.sym  # type: ignore[assignment]
    x = b.bufs[n_op.ins[0]]
    shape = dict(units=spec.rows, d=spec.cols, eps=spec.eps)
    return [lambda: kernel.gated_norm(x, w, z, out, out_q8=out_q8, **shape)]


def _step_norm(op: Op, b) -> tuple[Any, Any]:
    """A GdnStep's gated norm of its output (`norm_in_step`) as the step's `Normed` and the normed output's
    buffer, or (None, None) where the step writes its output as it is."""
    from fuselane.lanes.cuda.triton.gdn.delta import Normed

    if _one(op, RmsNorm) is None:
        return None, None
    n_op, w, z, out = _gated(op, b)
    return Normed(w, z, n_op.sym.eps, b.q8.get(op.out)), out  # type: ignore[union-attr]


def l2_norm(op: Op, b) -> list:
    """A bare L2Norm of heads (where the convolution's epilogue does not take them): one launch."""
    from fuselane.lanes.cuda.triton.gdn import norm as kernel

    spec: L2Norm = op.sym  # type: ignore[assignment]
    x, out = b.bufs[op.ins[0]], b.bufs[op.out]
    return [lambda: kernel.l2_norm(x, out, units=spec.rows, d=spec.cols, eps=spec.eps)]
