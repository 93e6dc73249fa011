"""The cpu lane's shim: it runs natively the fusions that save NumPy a pass over memory, and the rest apart.

A NumPy fusion pays where it keeps an intermediate out of the step's buffers: a norm with its weight, an
add with its norm, an activation with its multiply, a rotation that lands in the cache. Merging products
(q/k/v in parts, gate with up, a projection with its epilogue) gains NumPy nothing (each is its own BLAS
call), so those run as their parts. The lane refuses nothing a recognized model needs, reads activations
dequantized, and fuses exactly: a fused op computes its parts' numbers in their order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fuselane.fuse.shim import NATIVE, LaneRule, Position, Support, SupportKind
from fuselane.graph.classes import ClassId
from fuselane.graph.ir import Op, QuantFormat, TensorGraph
from fuselane.numerics.contract import Bound, Contract, Keep

CPU_NATIVE = frozenset(
    {
        ClassId.NORM_WEIGHT,
        ClassId.ADD_NORM,
        ClassId.NORM_THEN_ADD,
        ClassId.EMBED_NORM,
        ClassId.GLU_ACT_MUL,
        ClassId.GEMM_BIAS,
        ClassId.ROW_WRITE,
        ClassId.QK_NORM_ROPE,
        ClassId.QK_NORM_ROPE_KV_APPEND,
        ClassId.ROPE_KV_APPEND,
        ClassId.FLASH_DECODE,
        ClassId.FLASH_PREFILL,
        ClassId.STRIDED_READ,
        # a mixture's classes: one NumPy call a kept expert, whichever class groups them
        ClassId.ROUTER_TOPK,
        ClassId.MOE_TOKEN_SORT,
        ClassId.MOE_GATE_UP_ACT,
        ClassId.MOE_DOWN_COMBINE,
        ClassId.SHARED_EXPERT_FUSION,
        ClassId.MOE_DEFERRED_FINALIZE,
        # a gated delta-rule layer's and a gated attention's: each keeps an intermediate out of the step
        ClassId.CONV_BIAS_SILU,
        ClassId.CONV_SILU_L2NORM,
        ClassId.GDN_GATING,
        ClassId.GDN_STEP,
        ClassId.GATED_NORM,
        ClassId.ATTN_OUTPUT_GATE,
        ClassId.GROUPED_TOPK,  # deepseek2's grouped routing: NumPy ranks the groups, then their experts
    }
)

# Why the lane runs a class as its parts.
_PRODUCTS_APART = Support(
    SupportKind.DECOMPOSE, "NumPy runs each product as its own BLAS call; merging them saves nothing"
)
_MERGED_PRODUCTS = frozenset(
    {
        ClassId.MERGED_QKV,
        ClassId.MERGED_GATE_UP,
        ClassId.GEMV_GATE_UP_GLU,
        ClassId.GEMV_NORM_EPILOGUE,
        ClassId.QKV_HEAD_EPILOGUE,
        ClassId.FUSED_SAMPLING,
        ClassId.GEMM_DEQUANT_INKERNEL,
        ClassId.GDN_GATE_PROJECTIONS,
    }
)
_QUANT_APART = Support(SupportKind.DECOMPOSE, "the lane's products read dequantized activations")
_QUANTIZING = frozenset(
    {
        ClassId.NORM_QUANT,
        ClassId.ADD_NORM_QUANT,
        ClassId.GLU_ACT_MUL_QUANT,
        ClassId.ELEMENTWISE_QUANT,
        ClassId.GDN_OUTPUT_QUANT,
        ClassId.GEMV_QUANT,
        ClassId.ATTN_OUTPUT_QUANT,
        ClassId.ROW_WRITE_QUANT,
    }
)
_NO_FUNCTION = Support(SupportKind.DECOMPOSE, "the lane has no fused NumPy function for it; its parts run apart")

_KEEP = {np.dtype(np.float32): Keep.F32, np.dtype(np.float64): Keep.F64}


@dataclass(frozen=True, slots=True)
class CpuShim:
    """The cpu lane computing in `dtype`, with rules `held` back."""

    dtype: np.dtype = np.dtype(np.float32)
    held: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"cpu:{np.dtype(self.dtype).name}"

    def supports(self, cls: ClassId) -> Support:
        if cls in CPU_NATIVE:
            return NATIVE
        if cls in _MERGED_PRODUCTS:
            return _PRODUCTS_APART
        return _QUANT_APART if cls in _QUANTIZING else _NO_FUNCTION

    def fits(self, op: Op, g: TensorGraph) -> str | None:
        return None  # NumPy takes every shape

    def activation(self, consumer: Op, operand: int, g: TensorGraph) -> QuantFormat | None:
        return None  # products read dequantized activations

    def rules(self) -> list[tuple[Position, LaneRule]]:
        return []

    def numerics(self) -> Contract:
        keep = _KEEP[np.dtype(self.dtype)]
        return Contract(
            point=f"the cpu lane: {keep.value} arithmetic, {keep.value} cache, dequantized activations",
            activations=None,
            cache=keep,
            state=keep,
            attention=None,
            fused=Bound.EXACT,  # type: ignore[attr-defined]
            accumulator_bits=np.dtype(self.dtype).itemsize * 8,
            arithmetic=keep,
        )
