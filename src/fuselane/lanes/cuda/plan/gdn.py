"""The cuda lane's answers for the gated delta rule's and the gated attention's classes (Qwen3-Next).

The specification (the cuda lane's shim, credited in docs/design.md) runs the convolution with its SiLU and
its heads' L2 norm, several convolutions in one launch, the gates, the gates with their projection, the delta
step, the gated norm and the gated attention each in one launch (`SPECIFIED`), quantizes the gated norm's
output in its epilogue under `fuse_quant`, runs the three regroupings of a layer's fused ops as their parts,
and refuses a delta rule gated by a sigmoid (`fits`).

This lane runs every one of them as specified (`triton/gdn`, bound in `run/gdn_launch.py`): the convolution
(with its state's shift, SiLU and heads' L2 norm) and up to four of them a launch (ConvParts, each part its
own input, state, taps and output); the gates, and the gates with the `ssm_ba` product that feeds them
(GdnGateProjections, where the lane holds that matrix as values: `fits`); the delta step; the gated norm,
writing its int8 form in its store where its heads are whole 32-value blocks (GdnOutputQuant; narrower heads
quantize in a launch after it, the lane rule `quantize_apart`). The gated attention (AttnOutputGate)
multiplies by its gate's sigmoid in the attention's store (the decode and the chunk attention kernels; `fits`
keeps it to a step's and a short chunk's), writing its int8 form there too under `fuse_quant`.
"""

from __future__ import annotations

from fuselane.fuse.shim import DECOMPOSE, NATIVE, Support
from fuselane.fuse.views import leaves
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Op
from fuselane.graph.ops import RmsNorm
from fuselane.lanes.cuda.plan import kernels

# The specification's answer for each class (EPILOGUE: native under `fuse_quant`, else decomposed).
EPILOGUE = "native under fuse_quant"
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


def gated_norm_quantizes(op: Op) -> bool:
    """Whether a gated norm writes its int8 form in its own store: a program norms a head, so its heads must be
    whole 32-value blocks of the row (`triton/gdn/norm.py`)."""
    n = next((x.sym for x in leaves(op) if isinstance(x.sym, RmsNorm)), None)
    return n is not None and n.cols % kernels.QBLOCK == 0
