"""The cuda lane's answers for the gated delta rule's and the gated attention's classes (Qwen3-Next).

The specification (the cuda lane's shim, credited in docs/design.md) runs the convolution with its SiLU and its
heads' L2 norm, several convolutions in one launch, the gates, the gates with their projection, the delta step, the
gated norm and the gated attention each in one launch (`SPECIFIED`), quantizes the gated norm's output in its
epilogue under `fuse_quant`, runs the three regroupings of a layer's fused ops as their parts, and refuses a delta
rule gated by a sigmoid (`fits`).

This lane runs every one of them as specified (`triton/gdn`, bound in `run/gdn_launch.py`): the convolution (with
its state's shift, SiLU and heads' L2 norm) and up to four of them a launch (ConvParts, each part its own input,
state, taps and output); the gates, and the gates with the `ssm_ba` product that feeds them (GdnGateProjections,
from a matrix of floats where no GEMV in parts takes the product: `fits`); the delta step; the gated norm, writing
its int8 form in its store where its heads are whole 32-value blocks (GdnOutputQuant; narrower heads quantize in a
launch after it, the lane rule `quantize_apart`). The shared rules' regroupings of the step's launch run there too,
in the recurrence only: the step making its gates (`gates_in_step`) and norming its output with the norm's int8
form (`norm_in_step`, a program a head's whole value width). The gated attention (AttnOutputGate) multiplies by its
gate's sigmoid in the attention's store (the decode and the chunk attention kernels; `fits` keeps it to a step's
and a short chunk's), writing its int8 form there too under `fuse_quant`.

A chunk's delta step (GdnStep over more than one row) runs the chunked form (`triton/gdn/chunked.py`) in two
launches, every block's triangular system first, then the state across the blocks: the settling pass
`chunked_delta` sizes the fused op so, and its binder returns the two. The facts both read are here.
"""

from __future__ import annotations

from dataclasses import replace

from fuselane.fuse.shim import DECOMPOSE, NATIVE, Support
from fuselane.fuse.views import class_of, leaves
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Op
from fuselane.graph.ops import DeltaState, GatedDelta, RmsNorm
from fuselane.lanes.cuda.plan import kernels

# The specification's answer for each class (EPILOGUE: native under `fuse_quant`, else decomposed).
EPILOGUE = "native under fuse_quant"
# The `ssm_ba` formats the gates with their product take (GdnGateProjections): the binder makes an f32 copy of
# the matrix from these, and the fit declines any other.
GATE_MATRIX_FORMATS = frozenset({Format.F32, Format.F16, Format.BF16})
SPECIFIED: dict[C, Support | str] = {
    C.GDN_STEP: NATIVE,
    C.GDN_GATING: NATIVE,
    C.GDN_GATE_PROJECTIONS: NATIVE,
    C.CONV_BIAS_SILU: NATIVE,
    C.CONV_PARTS: NATIVE,
    C.CONV_SILU_L2NORM: NATIVE,
    C.GATED_NORM: NATIVE,
    C.ATTN_OUTPUT_GATE: NATIVE,
    C.GDN_OUTPUT_QUANT: EPILOGUE,
    C.GDN_INPUT_EPILOGUE: DECOMPOSE,
    C.GDN_DECODE_WHOLE: DECOMPOSE,
    C.GDN_POST_CONV_PREP: DECOMPOSE,
}

# The classes the lane runs in one launch each (`launch.BINDERS`).
GDN_NATIVE = frozenset(
    {
        *(C.GDN_STEP, C.GDN_GATING, C.GDN_GATE_PROJECTIONS, C.CONV_BIAS_SILU, C.CONV_PARTS, C.CONV_SILU_L2NORM),
        *(C.GATED_NORM, C.ATTN_OUTPUT_GATE),
    }
)


GATES_IN_STEP_FORM = (
    "the delta rule makes its gates from b and a in its launch only in the recurrence (a decode step's rows); "
    "the chunked form reads them made"
)


def gates_in_step(op: Op) -> str | None:
    """Why a GdnStep that makes its own gates (`gates_in_step`) has no launch here, or None where the recurrence
    (`triton/gdn/delta.py`) runs it: the chunked form's two launches read the gates a launch before made."""
    if not any(class_of(m) is C.GDN_GATING for m in op.sym.parts):  # type: ignore[union-attr]
        return None
    rule = delta_rule(op)
    return None if rule is not None and not delta_chunked(rule.rows, rule.dk) else GATES_IN_STEP_FORM


NORM_IN_STEP_FORM = (
    "the delta rule norms its output in its launch only in the recurrence (a decode step's rows), a program a "
    "head; the chunked form's programs hold parts of a head's values"
)
NORM_IN_STEP_WIDTH = (
    f"the delta rule norms its output in its launch in heads of at most {kernels.GDN_NORM_MOST_DV} values, "
    "a head's state a program"
)
NORM_IN_STEP_BLOCKS = "the delta rule quantizes its normed output in its store in heads of whole 32-value blocks"


def step_norm(op: Op) -> Op | None:
    """The gated norm (GatedNorm, or its GdnOutputQuant) a GdnStep applies to its output (`norm_in_step`)."""
    parts = op.sym.parts if class_of(op) is C.GDN_STEP else ()  # type: ignore[union-attr]
    return next((m for m in parts if class_of(m) in (C.GATED_NORM, C.GDN_OUTPUT_QUANT)), None)


def step_writes_int8(op: Op) -> bool:
    """Whether a GdnStep writes its normed output's int8 form in its store (its norm a GdnOutputQuant)."""
    norm = step_norm(op)
    return norm is not None and class_of(norm) is C.GDN_OUTPUT_QUANT


def norm_in_step(op: Op) -> str | None:
    """Why a GdnStep that norms its output (`norm_in_step`) has no launch here, or None where the recurrence
    (`triton/gdn/delta.py`, a program a head's whole value width) runs it."""
    norm = step_norm(op)
    if norm is None:
        return None
    rule = delta_rule(op)
    if rule is None or delta_chunked(rule.rows, rule.dk):
        return NORM_IN_STEP_FORM
    if rule.dv > kernels.GDN_NORM_MOST_DV:
        return NORM_IN_STEP_WIDTH
    if class_of(norm) is C.GDN_OUTPUT_QUANT and not gated_norm_quantizes(norm):
        return NORM_IN_STEP_BLOCKS
    return None


def gated_norm_quantizes(op: Op) -> bool:
    """Whether a gated norm writes its int8 form in its own store: a program norms a head, so its heads must be
    whole 32-value blocks of the row (`triton/gdn/norm.py`)."""
    n = next((x.sym for x in leaves(op) if isinstance(x.sym, RmsNorm)), None)
    return n is not None and n.cols % kernels.QBLOCK == 0


# --- the chunked delta rule over a chunk's rows (`triton/gdn/chunked.py`) ------------------------------------

DELTA_CHUNK = 64  # rows a block of the chunked form (the reference's chunk size)
DELTA_MIN_DOT = 16  # tl.dot's least extent: heads of fewer key values run the recurrence, a row a step
# The chunked form's launches: every block's system solved at once in a launch of its own, then the state
# across the blocks in a second ("split", the default: 352 against 1,034-1,180 us on a 512-row chunk at the
# 80B-A3B's widths, H200); or both in one launch, a head's blocks in turn ("whole", taken by a bare
# GatedDelta or DeltaState, which the plan counts as one launch each).
DELTA_FORMS = ("split", "whole")
DELTA_FORM_LAUNCHES = {"split": 2, "whole": 1}
DELTA_SPLIT, DELTA_WHOLE = DELTA_FORMS
CHUNKED_DELTA = "chunked_delta"  # the settling pass's name


def delta_dot_heads(dk: int) -> bool:
    """Whether the chunked form's products take heads of `dk` key values: a power of two of at least
    `DELTA_MIN_DOT`."""
    return dk >= DELTA_MIN_DOT and dk & (dk - 1) == 0


def delta_chunked(rows: int, dk: int) -> bool:
    """Whether a delta rule over `rows` rows of heads of `dk` key values runs the chunked form (a chunk's rows,
    heads its products take) rather than the recurrence, a row a step."""
    return rows > 1 and delta_dot_heads(dk)


def delta_rule(op: Op) -> GatedDelta | None:
    """The delta rule a GdnStep, a bare GatedDelta or a bare DeltaState runs."""
    for x in leaves(op):
        if isinstance(x.sym, GatedDelta):
            return x.sym
        if isinstance(x.sym, DeltaState):
            return x.sym.rule
    return None


def chunked_delta(r) -> None:
    """A chunk's GdnStep as the chunked form's two launches (`DELTA_SPLIT`): the plan counts what its binder
    returns."""
    for i in range(len(r.s)):
        op = r.s.slot(i)
        if op is None or class_of(op) is not C.GDN_STEP:
            continue
        rule = delta_rule(op)
        if rule is not None and delta_chunked(rule.rows, rule.dk):
            r.s.set(i, replace(op, sym=replace(op.sym, launches=DELTA_FORM_LAUNCHES[DELTA_SPLIT])))
