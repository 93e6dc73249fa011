"""The cuda lane's answers for the gated delta rule's and the gated attention's classes (Qwen3-Next).

The specification (the cuda lane's shim, credited in docs/design.md) runs the convolution with its SiLU and
its heads' L2 norm, the gates, their projections, the delta step, the gated norm and the gated attention each
in one launch (`SPECIFIED`), quantizes the gated norm's output in its epilogue under `fuse_quant`, runs the
three regroupings of a layer's fused ops as their parts, and refuses a delta rule gated by a sigmoid (`fits`).

This lane has no gated-delta kernels yet, so every class whose parts include the convolution, the softplus of
the decay or the rule itself is refused (`NOT_YET`): its parts have no launch either, so running them apart
would not be honest; a model with gated delta-rule layers is refused at load with this reason (the optimizer's
`needs`). The gated norm and the gated attention run as their parts (a norm, a SiLU or a sigmoid, products of
elementwise ops: launches the lane has), as the other classes it has no kernel for yet.
"""

from __future__ import annotations

from fuselane.fuse.shim import DECOMPOSE, NATIVE, Support
from fuselane.graph.classes import ClassId as C

NO_GDN_KERNELS = "the lane has no gated-delta kernels yet"

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

# Classes refused until the lane has the kernels (their parts have none either).
NOT_YET: dict[C, str] = {
    cls: NO_GDN_KERNELS
    for cls in (
        C.GDN_STEP,
        C.GDN_GATING,
        C.GDN_GATE_PROJECTIONS,
        C.CONV_BIAS_SILU,
        C.CONV_PARTS,
        C.CONV_SILU_L2NORM,
    )
}
