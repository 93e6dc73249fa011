"""The cuda lane's answers for the gated delta rule's and the gated attention's classes (Qwen3-Next).

The specification (the cuda lane's shim, credited in docs/design.md) runs the convolution with its SiLU and
its heads' L2 norm, the gates, their projections, the delta step, the gated norm and the gated attention each
in one launch (`SPECIFIED`), quantizes the gated norm's output in its epilogue under `fuse_quant`, runs the
three regroupings of a layer's fused ops as their parts, and refuses a delta rule gated by a sigmoid (`fits`).

This lane runs the convolution (with its state's shift, SiLU and heads' L2 norm), the gates, the delta step
and the gated norm natively (`triton/gdn`, bound in `run/gdn_launch.py`). Two native classes of the
specification have no kernel here (`NOT_YET`): several convolutions in one launch (no rule builds it: Qwen3-Next
convolves q, k and v as one) and the gates' projection with its gating (the specification's fit takes it only
by matrices held as values, never a checkpoint's rows): each runs as its parts, as the lane's other classes
without a kernel. The gated attention (AttnOutputGate) multiplies by its gate's sigmoid in the attention's
store (the decode and the chunk attention kernels; `fits` keeps it to a step's and a short chunk's), writing
its int8 form there too under `fuse_quant`; the gated norm quantizes its output in a launch after it (the lane
rule `quantize_apart`).
"""

from __future__ import annotations

from fuselane.fuse.shim import DECOMPOSE, NATIVE, Support
from fuselane.graph.classes import ClassId as C

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

# The specification's native classes this lane has no kernel for (no rule builds the first; the second's fit
# never takes a checkpoint's rows): their parts run apart.
NOT_YET = frozenset({C.CONV_PARTS, C.GDN_GATE_PROJECTIONS})
# The classes the lane runs in one launch each (`launch.BINDERS`).
GDN_NATIVE = frozenset(
    {C.GDN_STEP, C.GDN_GATING, C.CONV_BIAS_SILU, C.CONV_SILU_L2NORM, C.GATED_NORM, C.ATTN_OUTPUT_GATE}
)
