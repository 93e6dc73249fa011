"""The cuda lane's answer to "which fused classes do you run": native (one launch of the lane's kernels),
quantizing epilogues, run as their parts, or refused with the reason.

Why a module of its own: the sets are data the shim's `supports` reads, the launch binders are held to
(`launch.BINDERS`), and `explain` and the tests list; the shim's other answers are code.
"""

from __future__ import annotations

from fuselane.fuse.shim import Support, SupportKind
from fuselane.graph.classes import ClassId as C
from fuselane.lanes.cuda.plan.gdn import GDN_NATIVE

# A mixture's classes: the lane runs the first six in one launch each (`triton.moe`), and the masked activation
# and the gather in the operand as their parts, as the specification does (docs/moe.md).
MOE_CLASSES = frozenset(
    {
        *(C.ROUTER_TOPK, C.MOE_TOKEN_SORT, C.MOE_GATE_UP_ACT, C.MOE_DOWN_COMBINE, C.SHARED_EXPERT_FUSION),
        *(C.MOE_DEFERRED_FINALIZE, C.MASKED_EXPERT_ACTIVATION, C.MOE_GATHER_IN_OPERAND),
    }
)
MOE_DECOMPOSED = frozenset({C.MASKED_EXPERT_ACTIVATION, C.MOE_GATHER_IN_OPERAND})

# Classes a kernel of the lane runs in one launch (`Mla` in the three its rule sizes): each has its binder in
# `launch.BINDERS`, which a test holds this set to.
NATIVE_CLASSES = frozenset(
    {
        *(C.NORM_WEIGHT, C.ADD_NORM, C.EMBED_NORM, C.GEMV_NORM_EPILOGUE),
        *(C.QK_NORM_ROPE, C.QK_NORM_ROPE_KV_APPEND, C.ROPE_KV_APPEND, C.ROPE_QK_ONE_LAUNCH),
        *(C.FLASH_DECODE, C.FLASH_PREFILL, C.QKV_HEAD_EPILOGUE),
        *(C.GLU_ACT_MUL, C.GEMV_GATE_UP_GLU, C.GEMM_BIAS, C.MERGED_QKV, C.ROW_WRITE),
        *(MOE_CLASSES - MOE_DECOMPOSED),
        *GDN_NATIVE,
        C.MLA,  # a wide chunk's latent attention expanded: its three launches (`latent.latent_launches`)
        C.JOIN_IN_PLACE,  # the latent attention's joins: the query's and the cache row's (`fits`)
        C.MLA_PROLOGUE,  # both joins in one launch (`triton/mla/prologue.py`), which the specification's decomposes
    }
)

# Producers that quantize their result in their epilogue: native under `fuse_quant`, their parts apart
# otherwise. Where the producer's kernel writes no int8 form, the lane rule `quantize_apart` runs the producer
# and a quantizing launch after it.
QUANT_EPILOGUES = frozenset(
    {
        *(C.NORM_QUANT, C.ADD_NORM_QUANT, C.GLU_ACT_MUL_QUANT, C.ELEMENTWISE_QUANT, C.GDN_OUTPUT_QUANT),
        *(C.GEMV_QUANT, C.ATTN_OUTPUT_QUANT),
    }
)

# Classes the specification runs in one launch and this lane has no kernel for yet: their parts run apart,
# each its own launch (a model that needs none of them fused still runs).
NO_KERNEL_CLASSES = frozenset(
    {
        *(C.NORM_THEN_ADD, C.EMBED_SCALE, C.ATTENTION_VARIANTS_INLINE, C.ATTN_LSE_MERGE),
        *(C.MERGED_GATE_UP, C.GEMM_DEQUANT_INKERNEL, C.FUSED_SAMPLING, C.CUDA_GRAPHS),
        *(C.STRIDED_READ, C.STRIDED_VALUES),
        C.ROW_WRITE_QUANT,
    }
)
NO_KERNEL = Support(SupportKind.DECOMPOSE, "the lane has no kernel for it yet: its parts run apart")

# Classes the lane runs as their parts.
DECOMPOSED_CLASSES = NO_KERNEL_CLASSES | frozenset(
    {
        *(C.NORM_SCALE, C.NORM_WEIGHT_OFFSET, C.DUAL_NORM, C.PREFILL_NORM_EPILOGUES, C.ATTN_RESIDUAL_NORM),
        *(C.RECOMPUTE_FANOUT, C.QK_NORM_ROPE_GATE_SPLIT, C.HORIZONTAL_NORM_ROPE_INSERT, C.CROSS_LAYER_LAUNCH),
        *(C.MLA_UNABSORB_IN_FOLD, C.ELEMENTWISE_CHAINS, C.ELEMENTWISE_REGIONS),
        *(C.GEMM_SCALE, C.AFFINE_INPUT_FOLD, C.ROUTER_SHARED_GATE_MERGE),
        *(C.GDN_INPUT_EPILOGUE, C.GDN_DECODE_WHOLE, C.GDN_POST_CONV_PREP),
        C.LAST_LAYER_ROWS,
        *MOE_DECOMPOSED,
    }
)

# Classes no kernel of the lane runs, and why: a model that needs one cannot run here.
REFUSED_CLASSES: dict[C, str] = {
    C.RELU_SQR: "the lane links no ReLU",
    C.SOFTCAP: "the lane's attention takes no soft cap",
    C.MIXED_BATCH_ATTENTION: "the lane attends a batch's sequences each at its own position, none mid-prefill",
    C.SPARSE_ATTENTION: "the lane's attention reads every cached row of its span",
    C.GROUPED_TOPK: "the lane routes by one top-k over every expert",
    C.SAMPLING: "the lane picks the next token by arg-max",
    C.KV_CACHE_QUANT: "the lane stores its caches in f32 or f16",
    C.HADAMARD_ROTATION: "the lane rotates no cache",
    C.COMPENSATED_RESIDUAL: "the lane sums its residual in f32, uncompensated",
    C.HOST_RESIDENT_KV: "the lane keeps its caches on the device; only matrices move to host memory",
    C.ATTN_GQA_ROW_PACKING: "the lane's decode attention runs a head's dots on the CUDA cores",
    C.MOE_DIRECT_PAIRS: "the lane sorts a chunk's rows by expert",
    C.PERSISTENT_LAYER_MEGAKERNEL: "the lane replays a graph of a launch an op",
    C.ALLREDUCE_NORM: "the lane runs on one device",
}
